// The live dashboard: polls /metrics.json every second and draws what the engine is doing.
// Counters arrive cumulative; rates (tok/s, preemptions/s, 429/s) come from two samples' difference.

import { apiFetch, askForApiKey, errorMessage } from "./api.js";
import { LineChart, formatNumber } from "./charts.js";

const $ = (id) => document.getElementById(id);
const charts = {
  requests: new LineChart($("chart-requests")),
  kv: new LineChart($("chart-kv"), { unit: "%", minMax: 100 }),
  tokens: new LineChart($("chart-tokens")),
  ttft: new LineChart($("chart-ttft"), { minMax: 10 }),
  events: new LineChart($("chart-events")),
};
const RATE_WINDOW = 3; // rates are taken over the last 3 samples (seconds), so steps do not jitter them
let recent = []; // the last RATE_WINDOW + 1 samples
let waitingForKey = false;

function rate(now, key) {
  const before = recent[0];
  if (!before || before === now) return 0;
  const seconds = now.time - before.time;
  return seconds > 0 ? Math.max(0, now[key] - before[key]) / seconds : 0;
}

function setStatus(text, down) {
  $("status").textContent = text;
  $("status").classList.toggle("down", !!down);
}

function show(sample) {
  recent = [...recent, sample].slice(-(RATE_WINDOW + 1));
  const tokensPerSecond = rate(sample, "generation_tokens");
  $("model").textContent = sample.model;
  $("tile-running").textContent = sample.num_running;
  $("tile-waiting").textContent = sample.num_waiting;
  $("tile-kv").textContent = `${(sample.kv_cache_usage * 100).toFixed(1)}%`;
  $("tile-hit").textContent = `${(sample.prefix_cache_hit_rate * 100).toFixed(1)}%`;
  $("tile-toks").textContent = formatNumber(tokensPerSecond);
  $("tile-generated").textContent = formatNumber(sample.generation_tokens);
  $("tile-preempt").textContent = formatNumber(sample.num_preemptions);
  $("tile-429").textContent = formatNumber(sample.num_overloaded);
  const t = sample.time;
  charts.requests.push(t, { running: sample.num_running, waiting: sample.num_waiting });
  charts.kv.push(t, { "KV used": sample.kv_cache_usage * 100, "prefix hits": sample.prefix_cache_hit_rate * 100 });
  charts.tokens.push(t, { "tok/s": tokensPerSecond });
  const ttft = {};
  for (const [tier, numbers] of Object.entries(sample.ttft_by_tier)) {
    ttft[`${tier} p50`] = numbers.p50 * 1000;
    ttft[`${tier} p99`] = numbers.p99 * 1000;
  }
  charts.ttft.push(t, ttft);
  charts.events.push(t, {
    "preemptions/s": rate(sample, "num_preemptions"),
    "429/s": rate(sample, "num_overloaded"),
  });
  const engine = sample.engine_alive ? "engine up" : "engine down";
  setStatus(`${engine} · updated ${new Date(t * 1000).toLocaleTimeString()}`, !sample.engine_alive);
}

async function poll() {
  if (waitingForKey) return;
  try {
    const response = await apiFetch("/metrics.json");
    if (response.status === 401) {
      waitingForKey = true;
      setStatus("needs an API key", true);
      await askForApiKey("The dashboard's metrics need this server's API key.");
      waitingForKey = false;
      return;
    }
    if (!response.ok) {
      setStatus(await errorMessage(response), true);
      return;
    }
    show(await response.json());
  } catch {
    setStatus("cannot reach the server", true);
  }
}

poll();
setInterval(poll, 1000);
window.addEventListener("resize", () => Object.values(charts).forEach((chart) => chart.draw()));
document.body.dataset.ready = "true";
