// A small Markdown renderer for model output. Safety rule: every character of the source is
// HTML-escaped before any markup is added, and the only markup added is this file's own fixed tags;
// links keep only http(s) and mailto URLs. So a model that writes <script>, <img onerror=...> or a
// javascript: link gets that text shown, never run. Handles fenced code (with highlighting), headings,
// lists, block quotes, rules, tables, paragraphs, and inline code, bold, italic, strike and links.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

// ------------------------------------------------------------------------------------------------
// code highlighting: one pass of a tokenizing regex; every token is escaped, then wrapped in a span

const HASH_COMMENT_LANGS = new Set([
  "python", "py", "sh", "bash", "shell", "zsh", "ruby", "rb", "yaml", "yml", "toml", "r", "perl",
  "make", "makefile", "dockerfile", "ini", "conf",
]);
const KEYWORDS = new Set((
  "and as assert async await break case catch class const continue def default del do elif else " +
  "enum except export extends finally fn for from func function go if impl import in interface is " +
  "lambda let loop match mod mut new nonlocal not or package pass pub raise return select static " +
  "struct super switch this throw try type typeof use var void while with yield " +
  "True False None true false null nil undefined self"
).split(" "));

function tokenPattern(lang) {
  const hash = HASH_COMMENT_LANGS.has(lang);
  const slash = !hash || lang === "";
  const comments = [];
  if (slash) comments.push("\\/\\/[^\\n]*", "\\/\\*[\\s\\S]*?\\*\\/");
  if (hash || lang === "") comments.push("#[^\\n]*");
  return new RegExp(
    "(" + comments.join("|") + ")" +
      "|(\"\"\"[\\s\\S]*?\"\"\"|'''[\\s\\S]*?'''|\"(?:\\\\.|[^\"\\\\\\n])*\"|'(?:\\\\.|[^'\\\\\\n])*'|`(?:\\\\.|[^`\\\\])*`)" +
      "|(\\b0x[0-9a-fA-F]+\\b|\\b\\d[\\d_]*(?:\\.\\d+)?(?:[eE][+-]?\\d+)?\\b)" +
      "|([A-Za-z_$][\\w$]*)",
    "g",
  );
}

export function highlight(code, lang) {
  const pattern = tokenPattern((lang || "").toLowerCase());
  let out = "";
  let last = 0;
  for (const match of code.matchAll(pattern)) {
    out += escapeHtml(code.slice(last, match.index));
    const [text, comment, string, number, word] = match;
    let cls = null;
    if (comment !== undefined) cls = "tok-comment";
    else if (string !== undefined) cls = "tok-string";
    else if (number !== undefined) cls = "tok-number";
    else if (word !== undefined && KEYWORDS.has(word)) cls = "tok-keyword";
    else if (word !== undefined && code[match.index + text.length] === "(") cls = "tok-call";
    out += cls ? `<span class="${cls}">${escapeHtml(text)}</span>` : escapeHtml(text);
    last = match.index + text.length;
  }
  return out + escapeHtml(code.slice(last));
}

// ------------------------------------------------------------------------------------------------
// inline markup: code spans and links are set aside as placeholders, the rest is escaped, then
// emphasis is applied to the escaped text

const SAFE_URL = /^(https?:\/\/|mailto:)[^\s\u0000]*$/i;

export function safeUrl(url) {
  return SAFE_URL.test(url);
}

function renderInline(raw) {
  const stash = [];
  const keep = (html) => `\u0000${stash.push(html) - 1}\u0000`;
  let text = raw.replace(/\u0000/g, "");
  text = text.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g, (_, ticks, code) => keep(`<code>${escapeHtml(code)}</code>`));
  text = escapeHtml(text);
  // [label](url): the url is already escaped, so it cannot close the attribute's quotes
  text = text.replace(/\[([^\]\n]+)\]\(([^\s)]+)\)/g, (whole, label, url) =>
    safeUrl(url)
      ? keep(`<a href="${url}" target="_blank" rel="noopener noreferrer nofollow">${label}</a>`)
      : whole,
  );
  text = text.replace(/(^|[\s(])(https?:\/\/[^\s\u0000]*[^\s\u0000.,;:!?)])/g, (whole, before, url) =>
    before + keep(`<a href="${url}" target="_blank" rel="noopener noreferrer nofollow">${url}</a>`),
  );
  text = text
    .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
    .replace(/(^|[^\w*])\*(?=[^\s*])([^*\n]*?[^\s*])\*(?![\w*])/g, "$1<em>$2</em>")
    .replace(/(^|[^\w])_(?=[^\s_])([^_\n]*?[^\s_])_(?!\w)/g, "$1<em>$2</em>")
    .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
  for (let depth = 0; depth < 4 && text.includes("\u0000"); depth++) {
    text = text.replace(/\u0000(\d+)\u0000/g, (_, i) => stash[Number(i)] ?? "");
  }
  return text.replace(/\u0000/g, "");
}

// ------------------------------------------------------------------------------------------------
// blocks

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}>\s?/;
const LIST_ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_RULE = /^\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$/;

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || LIST_ITEM.test(line);
}

function tableCells(line) {
  return line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((cell) => cell.trim());
}

function renderBlocks(lines) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (!line.trim()) {
      i++;
      continue;
    }
    const fence = line.match(FENCE);
    if (fence) {
      const close = new RegExp("^ {0,3}" + fence[1][0] + "{" + fence[1].length + ",}\\s*$");
      const body = [];
      i++;
      while (i < lines.length && !close.test(lines[i])) body.push(lines[i++]);
      i++; // the closing fence (absent while a stream is still writing the block)
      const lang = fence[2] || "";
      const label = lang ? `<span class="code-lang">${escapeHtml(lang)}</span>` : "";
      out.push(`<pre class="code">${label}<code>${highlight(body.join("\n"), lang)}</code></pre>`);
      continue;
    }
    const heading = line.match(HEADING);
    if (heading) {
      const level = heading[1].length;
      out.push(`<h${level}>${renderInline(heading[2])}</h${level}>`);
      i++;
      continue;
    }
    if (RULE.test(line)) {
      out.push("<hr>");
      i++;
      continue;
    }
    if (QUOTE.test(line)) {
      const body = [];
      while (i < lines.length && lines[i].trim() && QUOTE.test(lines[i])) body.push(lines[i++].replace(QUOTE, ""));
      out.push(`<blockquote>${renderBlocks(body)}</blockquote>`);
      continue;
    }
    const item = line.match(LIST_ITEM);
    if (item) {
      const ordered = /\d/.test(item[2]);
      const items = [];
      while (i < lines.length) {
        const current = lines[i].match(LIST_ITEM);
        if (current && /\d/.test(current[2]) === ordered) {
          items.push([current[3]]);
          i++;
        } else if (lines[i].trim() && !startsBlock(lines[i]) && items.length) {
          items[items.length - 1].push(lines[i++].trim());
        } else {
          break;
        }
      }
      const tag = ordered ? "ol" : "ul";
      const start = ordered && parseInt(item[2], 10) !== 1 ? ` start="${parseInt(item[2], 10)}"` : "";
      out.push(`<${tag}${start}>${items.map((parts) => `<li>${renderInline(parts.join("\n")).replace(/\n/g, "<br>")}</li>`).join("")}</${tag}>`);
      continue;
    }
    if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1])) {
      const header = tableCells(line);
      i += 2;
      const rows = [];
      while (i < lines.length && lines[i].includes("|") && lines[i].trim()) rows.push(tableCells(lines[i++]));
      const head = header.map((cell) => `<th>${renderInline(cell)}</th>`).join("");
      const body = rows.map((row) => `<tr>${row.map((cell) => `<td>${renderInline(cell)}</td>`).join("")}</tr>`).join("");
      out.push(`<table><thead><tr>${head}</tr></thead><tbody>${body}</tbody></table>`);
      continue;
    }
    const paragraph = [];
    while (i < lines.length && lines[i].trim() && (paragraph.length === 0 || !startsBlock(lines[i]))) {
      paragraph.push(lines[i++]);
    }
    out.push(`<p>${renderInline(paragraph.join("\n")).replace(/\n/g, "<br>")}</p>`);
  }
  return out.join("");
}

/** The HTML for a Markdown `source`: escaped text inside this renderer's own tags only. */
export function renderMarkdown(source) {
  return renderBlocks(String(source ?? "").replace(/\r\n?/g, "\n").split("\n"));
}
