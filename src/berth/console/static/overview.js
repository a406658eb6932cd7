// berth console: the Overview page (the first page). The last hour at 10 s steps from
// GET /admin/metrics/history (kept in the leader's memory), for the whole cluster, one model
// or one node; each GPU's utilisation and memory; the leaders from GET /admin/leaders.
"use strict";

const OVERVIEW_POLL_MS = 5000;

function overviewPage(main) {
  const scope = h("select", { id: "overview-scope", "aria-describedby": "overview-kept" },
    h("option", { value: "cluster" }, "the whole cluster"));
  const kept = h("p", { class: "muted", id: "overview-kept" });
  const traffic = h("div", { class: "charts", id: "traffic-charts" });
  const gpus = h("div", { class: "charts", id: "gpu-charts" });
  const leaders = h("div", { id: "leaders" });
  const charts = {
    requests: timeChart("chart-requests", "Requests a second", [{ label: "requests" }],
      { unit: "/s" }),
    tokens: timeChart("chart-tokens", "Tokens a second",
      [{ label: "in (prompt)" }, { label: "out (completion)" }], { unit: "/s" }),
    ttft: timeChart("chart-ttft", "Time to first token", [{ label: "p50" }, { label: "p95" }],
      { unit: " ms" }),
    errors: timeChart("chart-errors", "Errors a second", [{ label: "errors" }], { unit: "/s" }),
  };
  traffic.append(...Object.values(charts).map((c) => c.element));
  const gpuCharts = new Map();
  let last = null;
  scope.addEventListener("change", () => { if (last) drawTraffic(last); });
  main.append(h("h1", {}, "Overview"), kept,
    h("form", { class: "inline", "aria-label": "what the charts show", onsubmit: (e) => e.preventDefault() },
      h("label", {}, "Show", scope)),
    h("h2", {}, "Traffic"), traffic, h("h2", {}, "GPUs"), gpus, h("h2", {}, "Leaders"), leaders);

  function chosen(history) {
    const [kind, ...rest] = scope.value.split(":");
    const name = rest.join(":");
    if (kind === "model") return history.models[name] || null;
    if (kind === "node") return history.nodes[name] || null;
    return history.cluster;
  }

  function drawTraffic(history) {
    const xs = history.at;
    const span = [Math.max(history.started_at, Date.now() / 1000 - history.kept_s),
      Date.now() / 1000];
    const found = chosen(history);
    const none = xs.map(() => null);
    const s = found || { requests: none, errors: none, prompt_tokens: none,
      completion_tokens: none, ttft_p50_ms: none, ttft_p95_ms: none };
    const rate = (values) => perSecond(values, history.step_s);
    charts.requests.update(xs, [rate(s.requests)], span);
    charts.tokens.update(xs, [rate(s.prompt_tokens), rate(s.completion_tokens)], span);
    charts.ttft.update(xs, [s.ttft_p50_ms, s.ttft_p95_ms], span);
    charts.errors.update(xs, [rate(s.errors)], span);
  }

  function drawGpus(history, labels) {
    const span = [Math.max(history.started_at, Date.now() / 1000 - history.kept_s),
      Date.now() / 1000];
    const wanted = new Set();
    for (const gpu of history.gpus) {
      const key = `${gpu.node}/${gpu.index}`;
      wanted.add(key);
      let chart = gpuCharts.get(key);
      if (!chart) {
        const label = labels[gpu.node] || gpu.node;
        chart = timeChart(`chart-gpu-${gpu.node}-${gpu.index}`,
          `${label} GPU ${gpu.index}${gpu.name ? ` (${gpu.name})` : ""}`,
          [{ label: "utilisation" }, { label: "memory used" }], { unit: "%", floor: 100 });
        gpuCharts.set(key, chart);
        gpus.append(chart.element);
      }
      const memory = gpu.mem_used_bytes.map((used, i) => {
        const total = gpu.mem_total_bytes[i];
        return used === null || !total ? null : (100 * used) / total;
      });
      chart.update(history.at, [gpu.util_pct, memory], span);
    }
    for (const [key, chart] of gpuCharts) {
      if (!wanted.has(key)) { chart.element.remove(); gpuCharts.delete(key); }
    }
    if (!history.gpus.length) {
      gpus.replaceChildren(h("p", { class: "no-data" }, "no data: no node reports a GPU"));
      gpuCharts.clear();
    } else {
      const stale = gpus.querySelector(":scope > p.no-data");
      if (stale) stale.remove();
    }
  }

  function drawScopes(history, labels) {
    const current = scope.value;
    const options = [h("option", { value: "cluster" }, "the whole cluster"),
      ...Object.keys(history.models).sort().map((m) => h("option", { value: `model:${m}` }, `model ${m}`)),
      ...Object.keys(history.nodes).sort().map((n) =>
        h("option", { value: `node:${n}` }, `node ${labels[n] || n}`))];
    scope.replaceChildren(...options);
    scope.value = options.some((o) => o.value === current) ? current : "cluster";
  }

  function drawLeaders(members) {
    leaders.replaceChildren(table(["leader", "role", "epoch", "cluster URL", "in flight",
      "requests a second", "seen"], members.map((m) => h("tr", { "data-leader": m.id },
      h("td", { class: "mono" }, m.id, m.this ? " (this one)" : ""),
      h("td", {}, statusText(m.role)),
      h("td", {}, m.epoch === null ? "—" : String(m.epoch)),
      h("td", { class: "mono" }, m.cluster_url || "—"),
      h("td", {}, m.in_flight === null ? "not known here" : String(m.in_flight)),
      h("td", {}, m.requests_per_s === null ? "not known here" : chartNumber(m.requests_per_s)),
      h("td", {}, m.seen_at ? `${ago(Date.now() / 1000 - m.seen_at)} ago` : "—")))));
  }

  every(OVERVIEW_POLL_MS, async () => {
    const [history, members, nodes] = await Promise.all([call("GET", "/admin/metrics/history"),
      call("GET", "/admin/leaders"), call("GET", "/admin/nodes")]);
    const labels = Object.fromEntries(nodes.map((n) => [n.id, n.label]));
    last = history;
    kept.textContent = `The last hour at ${history.step_s} s steps, kept in this leader's ` +
      `memory since ${new Date(history.started_at * 1000).toLocaleTimeString()}: reloading ` +
      "this page keeps it; a restart of the leader starts it anew.";
    drawScopes(history, labels);
    drawTraffic(history);
    drawGpus(history, labels);
    drawLeaders(members);
  });
}
