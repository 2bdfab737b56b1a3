// Line charts on <canvas>, drawn by hand: a rolling window of samples, one line per series, a
// y axis that fits the data, a legend with each series' latest value. No library.

const PALETTE = ["#1f6feb", "#e3693b", "#2da44e", "#a371f7", "#d4a72c", "#cf222e", "#0fa3b1", "#8c959f"];

export class LineChart {
  /** `options`: {unit: "", maxPoints: 120, minMax: 1 (the y axis shows at least 0..minMax)}. */
  constructor(canvas, options = {}) {
    this.canvas = canvas;
    this.unit = options.unit || "";
    this.maxPoints = options.maxPoints || 120;
    this.minMax = options.minMax ?? 1;
    this.series = new Map(); // name -> {color, values: (number|null)[]}
    this.times = [];
  }

  /** Add one sample: `values` maps series name to a number (null or missing: a gap). */
  push(time, values) {
    for (const name of Object.keys(values)) {
      if (!this.series.has(name)) {
        this.series.set(name, { color: PALETTE[this.series.size % PALETTE.length], values: this.times.map(() => null) });
      }
    }
    this.times.push(time);
    for (const [name, line] of this.series) line.values.push(values[name] ?? null);
    if (this.times.length > this.maxPoints) {
      this.times.shift();
      for (const line of this.series.values()) line.values.shift();
    }
    // For tests and curious users: how many samples the chart holds and the latest values.
    this.canvas.dataset.points = String(this.times.length);
    this.canvas.dataset.last = JSON.stringify(values);
    this.draw();
  }

  draw() {
    const canvas = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || 440;
    const height = canvas.clientHeight || 210;
    if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
      canvas.width = Math.round(width * ratio);
      canvas.height = Math.round(height * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const style = getComputedStyle(document.documentElement);
    const textColor = style.getPropertyValue("--muted").trim() || "#666";
    const gridColor = style.getPropertyValue("--line").trim() || "#ddd";
    const left = 48;
    const right = width - 10;
    ctx.font = "11px system-ui, sans-serif";
    // The legend (each series and its latest value) wraps over as many rows as it needs.
    const legend = [];
    let legendX = left;
    let legendY = 13;
    for (const [name, line] of this.series) {
      const last = line.values.at(-1);
      const label = `${name} ${last === null || last === undefined ? "–" : formatNumber(last) + this.unit}`;
      const itemWidth = ctx.measureText(label).width + 28;
      if (legendX > left && legendX + itemWidth > right) {
        legendX = left;
        legendY += 16;
      }
      legend.push({ label, color: line.color, x: legendX, y: legendY });
      legendX += itemWidth;
    }
    const top = legendY + 13;
    const bottom = height - 20;
    let max = this.minMax;
    for (const line of this.series.values()) for (const v of line.values) if (v !== null && v > max) max = v;
    max = niceCeiling(max);
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let i = 0; i <= 4; i++) {
      const value = (max * i) / 4;
      const y = bottom - ((bottom - top) * i) / 4;
      ctx.strokeStyle = gridColor;
      ctx.beginPath();
      ctx.moveTo(left, y);
      ctx.lineTo(right, y);
      ctx.stroke();
      ctx.fillStyle = textColor;
      ctx.fillText(formatNumber(value) + this.unit, left - 6, y);
    }
    ctx.textAlign = "left";
    ctx.fillText(`last ${this.maxPoints} s`, left, height - 8);
    const span = Math.max(1, this.maxPoints - 1);
    const x = (i) => right - ((this.times.length - 1 - i) * (right - left)) / span;
    const y = (v) => bottom - (v / max) * (bottom - top);
    for (const line of this.series.values()) {
      ctx.strokeStyle = line.color;
      ctx.lineWidth = 2;
      ctx.beginPath();
      let drawing = false;
      line.values.forEach((v, i) => {
        if (v === null) {
          drawing = false;
          return;
        }
        if (drawing) ctx.lineTo(x(i), y(v));
        else ctx.moveTo(x(i), y(v));
        drawing = true;
      });
      ctx.stroke();
    }
    ctx.textBaseline = "middle";
    for (const item of legend) {
      ctx.fillStyle = item.color;
      ctx.fillRect(item.x, item.y - 5, 10, 10);
      ctx.fillStyle = textColor;
      ctx.fillText(item.label, item.x + 14, item.y);
    }
  }
}

function niceCeiling(value) {
  const power = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 2.5, 5, 10]) if (value <= step * power) return step * power;
  return 10 * power;
}

export function formatNumber(value) {
  if (!Number.isFinite(value)) return "–";
  if (Math.abs(value) >= 1000) return Math.round(value).toLocaleString("en-US");
  if (Math.abs(value) >= 10 || Number.isInteger(value)) return String(Math.round(value * 10) / 10);
  return value.toFixed(2);
}
