// berth console: plain JavaScript, no build step, no third-party code.
// It talks only to the leader that served it: /ui/session, /admin/* and /v1/*, with the
// session cookie the leader set at sign-in. Every state-changing call sends the session's
// CSRF token (X-CSRF-Token), which lives in this page's memory only.
"use strict";

const POLL_MS = 5000;
const DISCONNECTED = "the leader did not answer (disconnected)";
const state = { csrf: null, keyName: "", timers: [], aborts: [], page: null };

// -- DOM helpers (text only: nothing from the API is ever parsed as HTML) ---------------------

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else el.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

const SVG_NS = "http://www.w3.org/2000/svg";
function sparkline(values, label) {
  const svg = document.createElementNS(SVG_NS, "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("viewBox", "0 0 100 40");
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", label);
  const line = document.createElementNS(SVG_NS, "polyline");
  const nums = values.map((v) => (typeof v === "number" ? v : 0));
  const max = Math.max(1, ...nums);
  const step = nums.length > 1 ? 100 / (nums.length - 1) : 100;
  const points = nums.map((v, i) => `${(i * step).toFixed(1)},${(38 - (v / max) * 36).toFixed(1)}`);
  line.setAttribute("points", points.join(" "));
  svg.dataset.values = nums.join(",");
  svg.append(line);
  return svg;
}

function meter(fraction, kind, label) {
  const bar = h("span");
  bar.style.width = `${Math.round(Math.max(0, Math.min(1, fraction)) * 100)}%`;
  return h("div", { class: `meter ${kind}`, role: "meter", "aria-label": label,
    "aria-valuemin": 0, "aria-valuemax": 100,
    "aria-valuenow": Math.round(fraction * 100) }, bar);
}

function facts(pairs) {
  return h("dl", { class: "facts" }, pairs.flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]));
}

function table(headers, rows, caption) {
  return h("div", { class: "table-wrap" }, h("table", {},
    caption ? h("caption", { class: "muted" }, caption) : null,
    h("thead", {}, h("tr", {}, headers.map((x) => h("th", { scope: "col" }, x)))),
    h("tbody", {}, rows)));
}

function statusText(value) {
  return h("span", { class: `status-${value}` }, value);
}

function ago(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m`;
  if (s < 86400) return `${Math.floor(s / 3600)}h${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d`;
}

function mib(bytes) {
  return `${Math.round(bytes / 1048576)} MiB`;
}

function sinceIso(iso) {
  return ago((Date.now() - Date.parse(iso)) / 1000);
}

// -- the API ----------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function setBanner(text) {
  const banner = document.getElementById("banner");
  banner.textContent = text || "";
  banner.hidden = !text;
}

async function call(method, path, body, extra) {
  const headers = { accept: "application/json" };
  if (body !== undefined) headers["content-type"] = "application/json";
  if (method !== "GET" && state.csrf) headers["x-csrf-token"] = state.csrf;
  let response;
  try {
    response = await fetch(path, {
      method, headers, credentials: "same-origin",
      body: body === undefined ? undefined : JSON.stringify(body),
      signal: extra && extra.signal,
    });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    setBanner("Disconnected from the leader: retrying…");
    throw new ApiError(0, DISCONNECTED);
  }
  setBanner("");
  const shown = document.getElementById("page-error");
  if (shown.textContent === DISCONNECTED) shown.textContent = ""; // it is back
  if (response.status === 401 && !path.startsWith("/ui/session")) {
    showSignIn("Your session has ended: sign in again.");
    throw new ApiError(401, "signed out");
  }
  if (extra && extra.raw) {
    if (!response.ok) throw new ApiError(response.status, await errorText(response));
    return response;
  }
  if (!response.ok) throw new ApiError(response.status, await errorText(response));
  const type = response.headers.get("content-type") || "";
  return type.includes("json") ? response.json() : response.text();
}

async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) { /* not JSON */ }
  return `the leader answered ${response.status} ${response.statusText}`;
}

function showError(err) {
  if (err && err.name === "AbortError") return;
  if (err instanceof ApiError && err.status === 401) return;
  document.getElementById("page-error").textContent = err ? err.message : "";
}

function clearError() {
  document.getElementById("page-error").textContent = "";
}

// -- sign-in ----------------------------------------------------------------------------------

function showSignIn(message) {
  stopPage();
  state.csrf = null;
  document.getElementById("app").hidden = true;
  document.getElementById("signin").hidden = false;
  document.getElementById("signin-error").textContent = message || "";
  document.getElementById("signin-key").focus();
}

function showApp(session) {
  state.csrf = session.csrf_token;
  state.keyName = session.key_name;
  document.getElementById("signin").hidden = true;
  document.getElementById("app").hidden = false;
  document.getElementById("who").textContent = `signed in as ${session.key_name}`;
  route();
}

async function signIn(event) {
  event.preventDefault();
  const input = document.getElementById("signin-key");
  const errorBox = document.getElementById("signin-error");
  errorBox.textContent = "";
  try {
    const session = await call("POST", "/ui/session", { key: input.value });
    input.value = "";
    showApp(session);
  } catch (err) {
    errorBox.textContent = err.message;
  }
}

async function signOut() {
  stopPage(); // no poll may race the session's end
  try {
    await call("DELETE", "/ui/session");
  } catch (err) {
    showError(err);
  }
  showSignIn("Signed out.");
}

// -- pages ------------------------------------------------------------------------------------

function stopPage() {
  for (const id of state.timers) clearInterval(id);
  for (const ctl of state.aborts) ctl.abort();
  state.timers = [];
  state.aborts = [];
}

function every(ms, fn) {
  const run = () => fn().catch(showError);
  run();
  state.timers.push(setInterval(run, ms));
}

function route() {
  if (!state.csrf) return;
  const name = (location.hash.replace(/^#\//, "") || "cluster").split("/")[0];
  const page = PAGES[name] || PAGES.cluster;
  stopPage();
  clearError();
  for (const link of document.querySelectorAll("nav a")) {
    if (link.dataset.page === name) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  const main = document.getElementById("main");
  main.replaceChildren();
  state.page = name;
  page(main);
}

// Cluster: a card per node, polled every 5 s from /admin/nodes and /admin/metrics/snapshot.
function clusterPage(main) {
  const cards = h("div", { class: "cards", id: "node-cards" });
  const enrollBox = h("div", { id: "enroll-box" });
  const label = h("input", { id: "enroll-label", required: true, placeholder: "gpu-2" });
  const form = h("form", { class: "inline", onsubmit: async (e) => {
    e.preventDefault();
    try {
      const [issued, info] = await Promise.all([
        call("POST", "/admin/nodes/enroll", { label: label.value }),
        call("GET", "/admin/info"),
      ]);
      enrollBox.replaceChildren(h("div", { class: "card" },
        h("h3", {}, `Enroll ${issued.label}`),
        h("p", {}, "On the new GPU host, run (single use, expires ",
          new Date(issued.expires_at * 1000).toLocaleString(), "):"),
        h("pre", { class: "secret", id: "enroll-command" },
          `berth agent register --uri '${issued.uri}'\nberth agent start`),
        facts([["CA fingerprint", h("code", { id: "ca-fingerprint" }, info.ca_fingerprint)]])));
      label.value = "";
    } catch (err) { showError(err); }
  } }, h("label", {}, "New node label", label), h("button", { type: "submit" }, "Enroll a node"));
  main.append(h("h1", {}, "Cluster"), cards, h("h2", {}, "Add a node"), form, enrollBox);

  every(POLL_MS, async () => {
    const [nodes, snapshot] = await Promise.all([
      call("GET", "/admin/nodes"), call("GET", "/admin/metrics/snapshot")]);
    const metrics = Object.fromEntries(snapshot.nodes.map((n) => [n.node, n]));
    cards.replaceChildren(...nodes.map((node) => nodeCard(node, metrics[node.id])));
  });
}

function nodeCard(node, metrics) {
  const latest = metrics ? metrics.latest : null;
  const deployments = latest ? latest.deployments : [];
  const inFlight = deployments.reduce((sum, d) => sum + d.in_flight, 0);
  const p95s = deployments.map((d) => d.latency_p95_ms).filter((v) => typeof v === "number");
  const gpus = latest ? latest.gpus : [];
  // Requests per sample, summed over the node's deployments: differences of the counters.
  let rates = [];
  if (metrics) {
    const columns = Object.values(metrics.series.deployments);
    const totals = metrics.series.at.map((_, i) =>
      columns.reduce((sum, c) => sum + (c.requests_total[i] || 0), 0));
    rates = totals.slice(1).map((v, i) => Math.max(0, v - totals[i]));
  }
  return h("article", { class: "card node", "data-node": node.id, "aria-label": `node ${node.label}` },
    h("h3", {}, node.label, " ", statusText(node.connected ? node.status : "unreachable")),
    facts([
      ["host", node.hostname || "—"],
      ["agent", node.agent_version || "—"],
      ["GPUs", `${node.gpu_count} (${node.vram_total_mb} MiB)`],
      ["in flight", h("span", { class: "in-flight" }, String(inFlight))],
      ["p95", p95s.length ? `${Math.round(Math.max(...p95s))} ms` : "—"],
      ["heartbeat", node.last_heartbeat_at ? `${ago(Date.now() / 1000 - node.last_heartbeat_at)} ago` : "—"],
    ]),
    h("div", { class: "gpus" }, gpus.map((g) => h("div", { class: "gpu" },
      h("span", {}, `GPU ${g.index}`),
      meter((g.util_pct || 0) / 100, "util", `GPU ${g.index} utilisation ${g.util_pct ?? "unknown"}%`),
      meter(g.mem_total_bytes ? g.mem_used_bytes / g.mem_total_bytes : 0, "mem",
        `GPU ${g.index} memory ${mib(g.mem_used_bytes)} of ${mib(g.mem_total_bytes)}`),
      h("span", { class: "gpu-text" }, `${g.name}: ` +
        `${g.util_pct === null ? "utilisation not reported" : `${g.util_pct}% busy`}, ` +
        `${mib(g.mem_used_bytes)} of ${mib(g.mem_total_bytes)}`)))),
    h("div", { class: "muted" }, "requests per heartbeat, last minute"),
    sparkline(rates, `requests on ${node.label} over the last minute`));
}

// Deployments: the list, start, stop, and a log panel that follows.
function deploymentsPage(main) {
  const list = h("div", { id: "deployments" });
  const logs = h("section", { id: "log-panel", "aria-label": "deployment log" });
  const model = h("select", { id: "deploy-model", required: true });
  const node = h("select", { id: "deploy-node" });
  const engine = h("select", { id: "deploy-engine" },
    ["llamacpp", "vllm", "sglang"].map((x) => h("option", { value: x }, x)));
  const form = h("form", { class: "inline", onsubmit: async (e) => {
    e.preventDefault();
    const button = form.querySelector("button");
    button.disabled = true;
    try {
      await call("POST", "/admin/deployments", {
        model: model.value, engine: engine.value, node: node.value || null });
      await refresh();
    } catch (err) { showError(err); } finally { button.disabled = false; }
  } },
  h("label", {}, "Model", model), h("label", {}, "Node", node), h("label", {}, "Engine", engine),
  h("button", { type: "submit" }, "Start"));
  main.append(h("h1", {}, "Deployments"), form, list, logs);

  Promise.all([call("GET", "/admin/models"), call("GET", "/admin/nodes")]).then(([models, nodes]) => {
    model.replaceChildren(...models.map((m) => h("option", { value: m.name }, m.name)));
    node.replaceChildren(h("option", { value: "" }, "where it fits"),
      ...nodes.map((n) => h("option", { value: n.label }, n.label)));
  }).catch(showError);

  async function refresh() {
    const rows = await call("GET", "/admin/deployments?active=true");
    list.replaceChildren(rows.length === 0 ? h("p", { class: "muted" }, "No deployments running.") :
      table(["id", "model", "served as", "state", "node", "GPUs", "uptime", ""], rows.map((d) =>
        h("tr", { "data-deployment": d.id },
          h("td", { class: "mono" }, d.id), h("td", {}, d.model_name),
          h("td", {}, d.served_model_name || d.model_name),
          h("td", {}, statusText(d.state), d.failure_reason ? ` ${d.failure_reason}` : "",
            d.progress ? ` (${d.progress})` : ""),
          h("td", {}, d.node_label, d.node_connected ? "" : " (unreachable)"),
          h("td", {}, d.gpus.length ? d.gpus.join(", ") : "—"),
          h("td", {}, sinceIso(d.created_at)),
          h("td", {},
            h("button", { type: "button", class: "secondary", onclick: () => follow(d.id) },
              "Logs"), " ",
            h("button", { type: "button", class: "danger", onclick: async (ev) => {
              ev.target.disabled = true;
              try { await call("POST", `/admin/deployments/${d.id}/stop`); await refresh(); }
              catch (err) { showError(err); ev.target.disabled = false; }
            } }, "Stop"))))));
  }

  async function follow(id) {
    for (const ctl of state.aborts) ctl.abort();
    state.aborts = [];
    const ctl = new AbortController();
    state.aborts.push(ctl);
    const out = h("pre", { class: "log", id: "log-output", tabindex: 0, "aria-live": "off" });
    logs.replaceChildren(h("h2", {}, `Log of ${id} (following)`), out);
    try {
      const response = await call("GET", `/admin/deployments/${id}/logs?follow=true&tail=200`,
        undefined, { raw: true, signal: ctl.signal });
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        out.append(decoder.decode(value, { stream: true }));
        out.scrollTop = out.scrollHeight;
      }
      out.append("\n— the log ended —\n");
    } catch (err) { showError(err); }
  }

  every(POLL_MS, refresh);
}

// Models: the registry; add a local file or folder, remove.
function modelsPage(main) {
  const list = h("div", { id: "models" });
  const name = h("input", { id: "model-name", required: true });
  const path = h("input", { id: "model-path", required: true, placeholder: "/models/x.gguf" });
  const node = h("input", { id: "model-node", placeholder: "optional: node label" });
  const form = h("form", { class: "inline", onsubmit: async (e) => {
    e.preventDefault();
    try {
      await call("POST", "/admin/models", { name: name.value, path: path.value,
        node: node.value || null });
      name.value = ""; path.value = ""; node.value = "";
      await refresh();
    } catch (err) { showError(err); }
  } }, h("label", {}, "Name", name), h("label", {}, "Path on the host", path),
  h("label", {}, "Node", node), h("button", { type: "submit" }, "Add"));
  main.append(h("h1", {}, "Models"), form, list,
    h("p", { class: "muted" }, "Pulling from Hugging Face: `berth pull` on the leader."));

  async function refresh() {
    const models = await call("GET", "/admin/models");
    list.replaceChildren(table(["name", "path", "source", "size", "on nodes", ""], models.map((m) =>
      h("tr", {}, h("td", {}, m.name), h("td", { class: "mono" }, m.path), h("td", {}, m.source),
        h("td", {}, m.size_bytes ? mib(m.size_bytes) : "—"),
        h("td", {}, Object.keys(m.locations || {}).join(", ") || "—"),
        h("td", {}, h("button", { type: "button", class: "danger", onclick: async () => {
          try { await call("DELETE", `/admin/models/${encodeURIComponent(m.name)}`); await refresh(); }
          catch (err) { showError(err); }
        } }, "Remove"))))));
  }
  refresh().catch(showError);
}

// Services and routes, and a dry-run placement (POST /admin/plan).
function servicesPage(main) {
  const services = h("div", { id: "services" });
  const routes = h("div", { id: "routes" });
  const target = h("input", { id: "plan-target", required: true, placeholder: "service or model" });
  const result = h("div", { id: "plan-result" });
  const form = h("form", { class: "inline", onsubmit: async (e) => {
    e.preventDefault();
    try {
      const plan = await call("POST", "/admin/plan", { target: target.value });
      result.replaceChildren(h("div", { class: "card" },
        h("h3", {}, plan.placed ? `Would run on ${plan.node_label}` : "Would not be placed"),
        facts([["model", plan.model], ["engine", plan.engine], ["GPUs", plan.gpus.join(", ") || "—"],
          ["estimate", plan.estimate ? plan.estimate.summary : (plan.estimate_problem || "—")],
          ["refusal", plan.refusal || "—"]]),
        h("ul", {}, plan.reasons.map((r) => h("li", {}, r)))));
    } catch (err) { showError(err); }
  } }, h("label", {}, "Target", target), h("button", { type: "submit" }, "Dry-run placement"));
  main.append(h("h1", {}, "Services and routes"), services, h("h2", {}, "Routes"), routes,
    h("h2", {}, "Where would it go?"), form, result);

  every(POLL_MS, async () => {
    const [svc, rts] = await Promise.all([call("GET", "/admin/services"), call("GET", "/admin/routes")]);
    services.replaceChildren(svc.length === 0 ? h("p", { class: "muted" }, "No services.") :
      table(["name", "model", "engine", "node", "ready", "routes"], svc.map((s) => h("tr", {},
        h("td", {}, s.name), h("td", {}, s.model), h("td", {}, s.engine),
        h("td", {}, s.node_label || "any"), h("td", {}, String(s.ready)),
        h("td", {}, s.routes.join(", ") || "—")))));
    routes.replaceChildren(rts.length === 0 ? h("p", { class: "muted" }, "No routes.") :
      table(["route", "services", "serving", "why"], rts.map((r) => h("tr", {},
        h("td", {}, r.name), h("td", {}, r.services.map((s) => `${s.service} (${s.ready} ready)`).join(", ")),
        h("td", {}, r.serving.join(", ") || "—"), h("td", {}, r.reason || "—")))));
  });
}

// Keys: create (the secret shown once), revoke, and usage from the leader's recent requests.
function keysPage(main) {
  const list = h("div", { id: "keys" });
  const secretBox = h("div", { id: "new-secret", "aria-live": "polite" });
  const usage = h("div", { id: "usage" });
  const name = h("input", { id: "key-name", required: true });
  const tier = h("select", { id: "key-tier" },
    h("option", { value: "standard" }, "standard"), h("option", { value: "admin" }, "admin"));
  const form = h("form", { class: "inline", onsubmit: async (e) => {
    e.preventDefault();
    try {
      const created = await call("POST", "/admin/keys", { name: name.value, tier: tier.value });
      secretBox.replaceChildren(h("div", { class: "card" },
        h("p", {}, `Key ${created.name} created. Copy its secret now: it is not shown again.`),
        h("div", { class: "secret", id: "key-secret" }, created.secret)));
      name.value = "";
      await refresh();
    } catch (err) { showError(err); }
  } }, h("label", {}, "Name", name), h("label", {}, "Tier", tier),
  h("button", { type: "submit" }, "Create key"));
  main.append(h("h1", {}, "Keys and usage"), form, secretBox, list, h("h2", {}, "Usage"), usage);

  async function refresh() {
    const keys = await call("GET", "/admin/keys");
    list.replaceChildren(table(["name", "tier", "prefix", "created", "state", ""], keys.map((k) =>
      h("tr", { "data-key": k.name }, h("td", {}, k.name), h("td", {}, k.tier),
        h("td", { class: "mono" }, k.prefix), h("td", {}, `${sinceIso(k.created_at)} ago`),
        h("td", {}, k.revoked_at ? statusText("revoked") : statusText("active")),
        h("td", {}, k.revoked_at ? "" : h("button", { type: "button", class: "danger",
          "aria-label": `Revoke ${k.name}`, onclick: async () => {
            if (!confirm(`Revoke key ${k.name}? Clients using it stop working at once.`)) return;
            try { await call("DELETE", `/admin/keys/${k.id}`); await refresh(); }
            catch (err) { showError(err); }
          } }, "Revoke"))))));
  }
  async function refreshUsage() {
    const page = await call("GET", "/admin/requests?limit=500");
    usage.replaceChildren(
      h("p", { class: "muted" }, `From the leader's last ${page.requests.length} requests ` +
        `(it keeps ${page.capacity}).`),
      usageBars("By key", groupUsage(page.requests, (r) => r.key_name || "(socket)"), "usage-by-key"),
      usageBars("By model", groupUsage(page.requests, (r) => r.model || "(none)"), "usage-by-model"),
      usageBars("By day", groupUsage(page.requests,
        (r) => new Date(r.at * 1000).toISOString().slice(0, 10)), "usage-by-day"));
  }
  refresh().catch(showError);
  every(POLL_MS, refreshUsage);
}

function groupUsage(requests, keyOf) {
  const groups = new Map();
  for (const r of requests) {
    const key = keyOf(r);
    const g = groups.get(key) || { requests: 0, tokens: 0 };
    g.requests += 1;
    g.tokens += r.prompt_tokens + r.completion_tokens;
    groups.set(key, g);
  }
  return [...groups.entries()].sort((a, b) => b[1].tokens - a[1].tokens || b[1].requests - a[1].requests);
}

function usageBars(title, groups, id) {
  const max = Math.max(1, ...groups.map(([, g]) => g.tokens));
  return h("section", { id, "aria-label": title }, h("h3", {}, title),
    groups.length === 0 ? h("p", { class: "muted" }, "No requests yet.") :
      h("div", { class: "bars" }, groups.map(([name, g]) => h("div", { class: "bar", "data-name": name },
        h("span", {}, name), meter(g.tokens / max, "util", `${name}: ${g.tokens} tokens`),
        h("span", { class: "mono" }, `${g.requests} req, ${g.tokens} tok`)))));
}

// Requests: the leader's ring of recent requests, polled for what is new.
function requestsPage(main) {
  const rows = [];
  const body = h("tbody", { id: "request-rows" });
  let after = 0;
  let labels = null; // node id -> label, read before the first rows are drawn
  const filter = h("input", { id: "request-filter", type: "search",
    placeholder: "key, model, node or status", oninput: () => draw() });
  const draw = () => {
    const wanted = filter.value.trim().toLowerCase();
    body.replaceChildren(...rows.filter((row) => !wanted || row.textContent.toLowerCase().includes(wanted)));
  };
  main.append(h("h1", {}, "Requests"),
    h("p", { class: "muted" }, "Recent /v1 requests, newest first. No prompt or answer is kept."),
    h("form", { class: "inline", onsubmit: (e) => e.preventDefault() },
      h("label", {}, "Filter", filter)),
    h("div", { class: "table-wrap" }, h("table", {},
      h("thead", {}, h("tr", {}, ["time", "key", "model", "node", "status", "TTFB", "duration",
        "tokens in/out", "retries"].map((x) => h("th", { scope: "col" }, x)))), body)));
  every(2000, async () => {
    if (labels === null) {
      const nodes = await call("GET", "/admin/nodes");
      labels = Object.fromEntries(nodes.map((n) => [n.id, n.label]));
    }
    const page = await call("GET", `/admin/requests?after=${after}&limit=200`);
    after = page.last_seq;
    for (const r of page.requests) {
      rows.unshift(h("tr", { "data-request": r.request_id },
        h("td", {}, new Date(r.at * 1000).toLocaleTimeString()), h("td", {}, r.key_name || "(socket)"),
        h("td", {}, r.model), h("td", {}, labels[r.node] || r.node || "—"),
        h("td", {}, String(r.status), r.error_reason ? ` ${r.error_reason}` : ""),
        h("td", {}, r.ttfb_ms === null ? "—" : `${r.ttfb_ms} ms`), h("td", {}, `${r.duration_ms} ms`),
        h("td", {}, `${r.prompt_tokens}/${r.completion_tokens}`),
        h("td", {}, r.retries.length ? `${r.retries.length}: ${r.retries.join(", ")}` : "0")));
    }
    rows.splice(500);
    draw();
  });
}

// Playground: a streamed chat with any served model.
function playgroundPage(main) {
  const model = h("select", { id: "chat-model", required: true });
  const prompt = h("textarea", { id: "chat-prompt", rows: 3, required: true });
  const log = h("div", { class: "chat", id: "chat-log", "aria-live": "polite" });
  const history = [];
  const form = h("form", { class: "inline", onsubmit: async (e) => {
    e.preventDefault();
    const text = prompt.value.trim();
    if (!text) return;
    prompt.value = "";
    history.push({ role: "user", content: text });
    log.append(h("div", { class: "msg user" }, text));
    const answer = h("div", { class: "msg assistant" });
    log.append(answer);
    const ctl = new AbortController();
    state.aborts.push(ctl);
    try {
      const response = await call("POST", "/v1/chat/completions",
        { model: model.value, messages: history, stream: true }, { raw: true, signal: ctl.signal });
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data:")) continue;
            const data = line.slice(5).trim();
            if (data === "[DONE]") continue;
            const chunk = JSON.parse(data);
            if (chunk.error) throw new Error(chunk.error.message || "the engine failed");
            const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
            if (delta && delta.content) answer.append(delta.content);
          }
        }
      }
      answer.dataset.done = "true";
      history.push({ role: "assistant", content: answer.textContent });
    } catch (err) { showError(err); }
  } }, h("label", {}, "Model", model), h("label", {}, "Message", prompt),
  h("button", { type: "submit" }, "Send"));
  main.append(h("h1", {}, "Playground"), log, form);
  call("GET", "/v1/models").then((list) => {
    model.replaceChildren(...list.data.map((m) => h("option", { value: m.id }, m.id)));
  }).catch(showError);
}

const PAGES = {
  cluster: clusterPage,
  deployments: deploymentsPage,
  models: modelsPage,
  services: servicesPage,
  keys: keysPage,
  requests: requestsPage,
  playground: playgroundPage,
};

// -- start ------------------------------------------------------------------------------------

async function start() {
  document.getElementById("signin-form").addEventListener("submit", signIn);
  document.getElementById("signout").addEventListener("click", signOut);
  window.addEventListener("hashchange", route);
  for (;;) {
    try {
      const current = await call("GET", "/ui/session");
      if (current.signed_in) showApp(current.session);
      else showSignIn("");
      return;
    } catch (_) {
      await new Promise((resolve) => setTimeout(resolve, POLL_MS)); // the leader is away
    }
  }
}

document.addEventListener("DOMContentLoaded", start);
