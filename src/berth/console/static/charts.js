// berth console: time charts drawn by uPlot (vendored: uPlot.iife.min.js, MIT, see
// uPlot.LICENSE.txt). One helper for every page: a titled figure whose chart is redrawn with
// new data, a text summary beside it for screen readers and keyboards, and "no data" in place
// of a chart whose series have nothing to show (never a flat zero).
"use strict";

const CHART_COLORS = ["#1f5fbf", "#8250df", "#1a7f37", "#cf222e", "#9a6700", "#0a7f83"];

// A number as the charts' text says it: "0", "0.15", "12.3", "1,234".
function chartNumber(value) {
  if (value === null || value === undefined) return "—";
  const abs = Math.abs(value);
  if (abs >= 1000) return Math.round(value).toLocaleString("en");
  if (abs >= 10) return value.toFixed(1).replace(/\.0$/, "");
  return value.toFixed(2).replace(/\.?0+$/, "") || "0";
}

// A figure holding one uPlot chart. `series` are [{label, unit?}]; `unit` is the y axis' unit
// ("/s", "ms", "%"). Returns {element, update(xs, ys, span)}: `xs` are epoch seconds, `ys` one
// array per series (null where there is no value), `span` the [from, to] the x axis shows. The uPlot instance is `element.chart` once drawn,
// its data `element.chart.data` (what the page draws: the test reads it from there).
function timeChart(id, title, series, opts) {
  const options = opts || {};
  const plot = h("div", { class: "plot" });
  const summary = h("p", { class: "chart-summary muted", id: `${id}-summary` });
  const empty = h("p", { class: "no-data", hidden: true }, "no data");
  const element = h("figure", { class: "chart", id, "aria-labelledby": `${id}-title`,
    "aria-describedby": `${id}-summary` },
  h("figcaption", { id: `${id}-title` }, title), empty, plot, summary);
  let chart = null;
  let resize = null;
  let xSpan = null; // [from, to] epoch seconds the x axis spans (null: the data's own)

  function width() {
    return Math.max(200, Math.floor((element.clientWidth || 600) - 2));
  }

  function update(xs, ys, span) {
    xSpan = span || null;
    const hasData = ys.some((values) => values.some((v) => v !== null && v !== undefined));
    element.dataset.empty = hasData ? "false" : "true";
    empty.hidden = hasData;
    plot.hidden = !hasData;
    summary.textContent = hasData ? series.map((s, i) => {
      const values = ys[i].filter((v) => v !== null && v !== undefined);
      if (!values.length) return `${s.label}: no data`;
      const last = values[values.length - 1];
      const max = Math.max(...values);
      return `${s.label}: now ${chartNumber(last)}${options.unit || ""}, ` +
        `peak ${chartNumber(max)}${options.unit || ""}`;
    }).join("; ") : `${title}: no data`;
    const data = [xs, ...ys];
    if (chart === null) {
      chart = new uPlot({
        width: width(),
        height: options.height || 160,
        legend: { show: series.length > 1 || options.legend === true },
        cursor: { drag: { x: false, y: false } },
        scales: { x: { time: true, range: (_u, min, max) => xSpan || [min, max] }, y: { range: (_u, min, max) => [0, Math.max(max, options.floor || 1)] } },
        axes: [{ values: (_u, ticks) => ticks.map((t) => clockText(t, ticks)) },
          { size: 56, values: (_u, ticks) => ticks.map((t) => chartNumber(t)) }],
        series: [{}, ...series.map((s, i) => ({ label: s.label, stroke: CHART_COLORS[i % CHART_COLORS.length],
          width: 1.5, spanGaps: false, value: (_u, v) => `${chartNumber(v)}${options.unit || ""}` }))],
      }, data, plot);
      element.chart = chart;
      if (typeof ResizeObserver === "function") {
        resize = new ResizeObserver(() => chart.setSize({ width: width(), height: options.height || 160 }));
        resize.observe(element);
      }
    } else {
      chart.setData(data);
    }
  }
  return { element, update };
}

// A tick of the time axis in the browser's time zone: "14:05", or "14:05:30" when the ticks
// are less than a minute apart.
function clockText(epochS, ticks) {
  const seconds = ticks.length > 1 && ticks[1] - ticks[0] < 60;
  return new Date(epochS * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit",
    second: seconds ? "2-digit" : undefined, hour12: false });
}

// Rates from counts per step: each count divided by the step (null stays null).
function perSecond(values, stepS) {
  return values.map((v) => (v === null || v === undefined ? null : v / stepS));
}
