"""The web console in a real browser: Playwright driving Debian's Chromium against a real
leader and an agent running the fake engine (``support/fake_llama_server.py``).

One leader for the module; the main test walks the console as an operator would (sign in,
watch the node, start a deployment and follow its log, create a key and see its usage,
revoke it, chat in the playground, stop the deployment, sign out) and fails on any message
the page logs as an error. Screenshots of each page go to ``BERTH_CONSOLE_SCREENSHOTS`` when
set (``docs/console/`` holds the ones ``docs/console.md`` shows), else to the test's folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from support.cluster_harness import Cluster, started_cluster
from support.fake_llama_server import USAGE
from support.hub_standin import HubStandin

pytestmark = [pytest.mark.slow, pytest.mark.needs("chromium")]

#: Milliseconds Playwright waits for what the page should show (a loaded machine is slow).
WAIT_MS = 30_000
#: The issue's bound for a node card's traffic chart to show new traffic, plus a margin for
#: a loaded CI machine (heartbeats here are 1 s apart and the page polls every 5 s).
TRAFFIC_WAIT_MS = 15_000
#: The Overview's steps are 10 s and the page polls every 5 s: a step closes, then is drawn.
HISTORY_WAIT_MS = 45_000
#: The sum of a drawn series (a uPlot chart's data), in the page.
SERIES_SUM = (
    "([sel, i]) => { const f = document.querySelector(sel);"
    " return f && f.chart ? f.chart.data[i].reduce((a, v) => a + (v || 0), 0) : null; }"
)


@pytest.fixture(scope="module")
def console_leader(
    tmp_path_factory: pytest.TempPathFactory, hub: HubStandin
) -> Iterator[tuple[Cluster, str]]:
    """A leader with agent ``gpu-a`` (one simulated 8 GiB GPU), model ``tiny`` registered on
    it, and an admin key (returned beside the cluster); it pulls from the hub stand-in."""
    root = tmp_path_factory.mktemp("console")
    settings = {
        "BERTH_HEARTBEAT_INTERVAL_S": "1",
        "HF_ENDPOINT": hub.url,
        "HF_HUB_CACHE": str(root / "hf-cache"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    with started_cluster(root, settings) as cluster:
        cluster.env["BERTH_SIMULATED_GPUS"] = "8GiB"
        agent = cluster.add_agent("gpu-a")
        cluster.berth("models", "add", "tiny", str(root / "tiny.gguf"), "--node", agent.label)
        created = cluster.berth("key", "create", "operator", "--tier", "admin").stdout
        found = re.search(r"sk-berth-\S+", created)
        assert found, created
        yield cluster, found.group(0)


@pytest.fixture(scope="module")
def chromium_browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=shutil.which("chromium"), args=["--disable-dev-shm-usage"]
        )
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def screenshot_dir(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("BERTH_CONSOLE_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _page(browser: Any, width: int = 1280, height: int = 800) -> tuple[Any, Any, list[str]]:
    viewport = {"width": width, "height": height}
    context = browser.new_context(ignore_https_errors=True, viewport=viewport)
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    errors: list[str] = []
    page.on(
        "console",
        lambda msg: errors.append(f"{msg.text} at {msg.location}") if msg.type == "error" else None,
    )
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("dialog", lambda dialog: dialog.accept())
    return context, page, errors


def _sign_in(page: Any, base_url: str, key: str) -> Any:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    failed: list[str] = []  # what the page could not load: the form shows once app.js ran
    page.on("requestfailed", lambda request: failed.append(f"{request.url}: {request.failure}"))
    answer = page.goto(base_url + "/")
    assert page.url == base_url + "/ui/"  # a browser asking for / is sent to the console
    try:
        page.get_by_label("Admin key").fill(key)
    except PlaywrightTimeout as exc:  # seen once in a full run under load; say what the page had
        shown = page.evaluate("() => document.body.innerText.slice(0, 400)")
        raise AssertionError(f"no sign-in form; failed: {failed}; page: {shown!r}") from exc
    page.get_by_role("button", name="Sign in").click()
    return answer


def _chat_client(cluster: Cluster, key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{cluster.base_url}/v1",
        api_key=key,
        http_client=openai.DefaultHttpxClient(verify=cluster.tls()),
        max_retries=0,
    )


def test_an_operator_walks_the_console(
    console_leader: tuple[Cluster, str], chromium_browser: Any, screenshot_dir: Path
) -> None:
    from playwright.sync_api import expect

    cluster, admin_key = console_leader
    context, page, errors = _page(chromium_browser)
    answer = _sign_in(page, cluster.base_url, admin_key)
    page.get_by_text("signed in as operator").wait_for()
    csp = answer.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp
    assert "unsafe-inline" not in csp
    cookie = next(c for c in context.cookies() if c["name"] == "berth_session")
    assert cookie["httpOnly"] and cookie["secure"] and cookie["sameSite"] == "Strict"
    assert admin_key not in str(context.cookies())

    # The Overview is the first page; the Cluster page: the node's card, with its GPU.
    page.locator("#chart-requests").wait_for()
    page.get_by_role("link", name="Cluster").click()
    card = page.locator("article[aria-label='node gpu-a']")
    card.get_by_text("ready").wait_for()
    card.locator(".gpu").first.wait_for()
    # Its data path: an agent on this host dials the leader, which reaches it direct or
    # through the tunnel, and says why.
    expect(card.locator(".data-path")).to_contain_text(re.compile(r"^(direct|tunnel): \S"))
    # Enroll: the command for the new host and the CA fingerprint to check it against.
    page.get_by_label("New node label").fill("gpu-b")
    page.get_by_role("button", name="Enroll a node").click()
    command = page.locator("#enroll-command").inner_text()
    assert command.startswith("berth agent register --uri 'berth://enroll?")
    fingerprint = cluster.admin("GET", "/admin/info")["ca_fingerprint"]
    assert page.locator("#ca-fingerprint").inner_text() == fingerprint
    page.screenshot(path=screenshot_dir / "cluster.png", full_page=True)

    # Deployments: start tiny on gpu-a, follow its log.
    page.get_by_role("link", name="Deployments").click()
    page.get_by_label("Model").select_option("tiny")
    page.get_by_label("Node").select_option("gpu-a")
    page.get_by_role("button", name="Start").click()
    row = page.locator("tr[data-deployment]").filter(has_text="tiny")
    row.locator(".status-ready").wait_for(timeout=60_000)
    row.get_by_role("button", name="Logs").click()
    log = page.locator("#log-output")
    log.get_by_text("fake llama-server: model").wait_for()
    with _chat_client(cluster, cluster.api_key) as client:  # the followed log shows it
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    log.get_by_text("POST /v1/chat/completions").wait_for()
    page.screenshot(path=screenshot_dir / "deployments.png", full_page=True)

    # Keys: create a standard key, see its secret once.
    page.get_by_role("link", name="Keys").click()
    page.get_by_label("Name").fill("browser-client")
    page.get_by_role("button", name="Create key").click()
    secret = page.locator("#key-secret").inner_text().strip()
    assert secret.startswith("sk-berth-")
    # Its limits: one of its own beside its tier's, and what it uses now.
    cluster.admin("PATCH", "/admin/keys/browser-client", json={"rpm": 77})
    page.reload()
    key_row = page.locator("tr[data-key='browser-client']")
    expect(key_row.locator(".limits")).to_contain_text("77 rpm*")
    expect(key_row.locator(".use")).to_contain_text("0 in flight")

    # Traffic with that key: the node's traffic chart (uPlot) moves, the key's usage shows it.
    page.get_by_role("link", name="Cluster").click()
    node_chart = "article[aria-label='node gpu-a'] figure.chart"
    page.wait_for_function(f"(arg) => ({SERIES_SUM})(arg) !== null", arg=[node_chart, 1])
    before = page.evaluate(SERIES_SUM, [node_chart, 1])
    with _chat_client(cluster, secret) as client:
        for _ in range(3):
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}]
            )
    # The chart's values are requests per heartbeat over the last minute: they sum to 3 more.
    page.wait_for_function(
        f"([sel, old]) => ({SERIES_SUM})([sel, 1]) >= old + 3",
        arg=[node_chart, before],
        timeout=TRAFFIC_WAIT_MS,
    )
    page.screenshot(path=screenshot_dir / "cluster-traffic.png", full_page=True)

    page.get_by_role("link", name="Keys").click()
    # Usage from the ledger: by key, by model and by day (UTC), with real token counts.
    usage = page.locator("#usage-by-key .bar[data-name='browser-client']")
    usage.get_by_text(re.compile(r"^3 req, [1-9]\d* tok$")).wait_for()
    page.locator("#usage-by-model .bar[data-name='tiny']").get_by_text(" req, ").wait_for()
    today = cluster.admin("GET", "/admin/usage?by=day")["until"]
    page.locator(f"#usage-by-day .bar[data-name='{today}']").get_by_text(" req, ").wait_for()
    expect(key_row.locator(".limits")).to_contain_text("77 rpm*")
    page.screenshot(path=screenshot_dir / "keys.png", full_page=True)
    page.get_by_role("button", name="Revoke browser-client").click()
    page.locator("tr[data-key='browser-client']").get_by_text("revoked").wait_for()
    with _chat_client(cluster, secret) as client, pytest.raises(openai.AuthenticationError):
        client.models.list()

    # Requests: the three, with the key's name, and no prompt text anywhere.
    page.get_by_role("link", name="Requests").click()
    page.locator("#request-rows tr").first.wait_for()
    page.get_by_label("Filter").fill("browser-client")
    expect(page.locator("#request-rows tr")).to_have_count(3)
    expect(page.locator("#request-rows tr").first).to_contain_text("gpu-a")  # the node's label
    assert "hi" not in page.locator("#request-rows").inner_text().split()
    page.screenshot(path=screenshot_dir / "requests.png", full_page=True)

    # Playground: a streamed answer, through the session (no key in the page).
    page.get_by_role("link", name="Playground").click()
    page.get_by_label("Model").select_option("tiny")
    page.get_by_label("Message").fill("Say something")
    page.get_by_role("button", name="Send").click()
    reply = page.locator("#chat-log .msg.assistant[data-done='true']")
    reply.wait_for()
    assert reply.inner_text().strip()
    page.screenshot(path=screenshot_dir / "playground.png", full_page=True)

    # Services: a service's scaling settings and the controller's decision about it, why.
    cluster.admin(
        "POST",
        "/admin/services",
        json={
            "name": "tiny-svc",
            "model": "tiny",
            "max_replicas": 2,
            "idle_timeout": "10m",
            "priority": 5,
        },
    )
    page.get_by_role("link", name="Services").click()
    service_row = page.locator("tr[data-service='tiny-svc']")
    expect(service_row.locator(".replicas")).to_contain_text("0 (min 0, max 2)")
    expect(service_row.locator(".scaling")).to_contain_text("idle out after 10m")
    expect(service_row.locator(".scaling")).to_contain_text("priority 5")
    expect(service_row.locator(".decision")).to_contain_text(re.compile(r"now: hold\S*: \S"))
    page.screenshot(path=screenshot_dir / "services.png", full_page=True)

    # The other pages draw without errors.
    for name, shot in (("Models", "models.png"),):
        page.get_by_role("link", name=name).click()
        page.locator("main table, main p.muted").first.wait_for()
        page.screenshot(path=screenshot_dir / shot, full_page=True)

    # Phone width: the cluster page still reads.
    page.set_viewport_size({"width": 390, "height": 844})
    page.get_by_role("link", name="Cluster").click()
    card.get_by_text("ready").wait_for()
    page.screenshot(path=screenshot_dir / "cluster-phone.png", full_page=True)
    page.set_viewport_size({"width": 1280, "height": 800})

    # Stop the deployment, sign out: the cookie no longer opens the admin API.
    page.get_by_role("link", name="Deployments").click()
    row.get_by_role("button", name="Stop").click()
    # An ended deployment stays listed for a while (as in `berth ps`), stopped, with no Stop.
    row.locator(".status-stopped").wait_for(timeout=60_000)
    assert row.get_by_role("button", name="Stop").count() == 0
    page.get_by_role("button", name="Sign out").click()
    page.get_by_label("Admin key").wait_for()
    assert context.request.get(cluster.base_url + "/admin/nodes").status == 401
    assert errors == []
    context.close()


def _scraped(cluster: Cluster) -> dict[str, dict[str, float]]:
    """``/metrics``' request and token counters, by family and label set."""
    with cluster.http() as http:
        text = http.get("/metrics").text
    found: dict[str, dict[str, float]] = {}
    for family in ("requests", "prompt_tokens", "completion_tokens"):
        name = f"berth_proxy_{family}_total"
        pattern = rf"^{name}(\{{[^}}]*\}}) (\S+)$"
        found[family] = {labels: float(v) for labels, v in re.findall(pattern, text, re.M)}
    return found


def _grew(before: dict[str, float], after: dict[str, float]) -> float:
    """How much a counter family grew (series that went in between grew by nothing)."""
    return sum(value - before.get(labels, 0.0) for labels, value in after.items())


def test_the_overview_charts_agree_with_metrics_and_work_with_the_keyboard(
    console_leader: tuple[Cluster, str], chromium_browser: Any, screenshot_dir: Path
) -> None:
    """The Overview's charts (uPlot) over a window agree with ``/metrics``: the requests
    within one, the tokens exactly; "no data" where a series has none; the page and a drain
    from the Cluster page with the keyboard alone; screenshots at 1280x800 and phone width."""
    from playwright.sync_api import expect

    cluster, admin_key = console_leader
    ran = cluster.berth("run", "tiny", "--node", "gpu-a").stdout
    deployment = re.search(r"\bd-[0-9a-f]{8}\b", ran)
    assert deployment, ran
    context, page, errors = _page(chromium_browser)
    _sign_in(page, cluster.base_url, admin_key)
    page.get_by_text("signed in as operator").wait_for()
    assert page.url.endswith("/ui/")  # the first page
    expect(page.get_by_role("link", name="Overview")).to_have_attribute("aria-current", "page")
    expect(page.locator("#overview-kept")).to_contain_text("a restart of the leader starts it anew")

    def drawn_after(at: float) -> None:
        """Wait until the charts show a step that closed after ``at`` (epoch s)."""
        page.wait_for_function(
            "t => { const f = document.querySelector('#chart-requests');"
            " if (!f || !f.chart) return false; const xs = f.chart.data[0];"
            " return xs.length > 0 && xs[xs.length - 1] > t; }",
            arg=at,
            timeout=HISTORY_WAIT_MS,
        )

    def drawn() -> tuple[float, float, float]:
        step = cluster.admin("GET", "/admin/metrics/history")["step_s"]
        per_s = [
            page.evaluate(SERIES_SUM, ["#chart-requests", 1]),
            page.evaluate(SERIES_SUM, ["#chart-tokens", 1]),
            page.evaluate(SERIES_SUM, ["#chart-tokens", 2]),
        ]
        return (per_s[0] * step, per_s[1] * step, per_s[2] * step)

    # Quiet now: once a step has closed after this moment, the charts hold every request.
    drawn_after(time.time())
    scraped_before, charted_before = _scraped(cluster), drawn()
    sent = 7
    with _chat_client(cluster, cluster.api_key) as client:
        for _ in range(sent):
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "count me"}]
            )
    drawn_after(time.time())
    scraped_after, charted_after = _scraped(cluster), drawn()
    requests = _grew(scraped_before["requests"], scraped_after["requests"])
    prompt = _grew(scraped_before["prompt_tokens"], scraped_after["prompt_tokens"])
    completion = _grew(scraped_before["completion_tokens"], scraped_after["completion_tokens"])
    assert requests == sent and prompt == sent * USAGE[0] and completion == sent * USAGE[1]
    assert abs(round(charted_after[0] - charted_before[0]) - requests) <= 1
    assert round(charted_after[1] - charted_before[1]) == prompt
    assert round(charted_after[2] - charted_before[2]) == completion
    expect(page.locator("#chart-ttft")).to_have_attribute("data-empty", "false")
    # A simulated GPU reports no utilisation: its chart says so, it draws no zero line.
    gpu_chart = page.locator("figure.chart[id^='chart-gpu-']").first
    expect(gpu_chart.locator(".chart-summary")).to_contain_text("utilisation: no data")
    assert page.evaluate(
        "sel => document.querySelector(sel).chart.data[1].every((v) => v === null)",
        "figure.chart[id^='chart-gpu-']",
    )
    # The leaders: this one, active (no shared leadership: epoch 0), with its load.
    leader_row = page.locator("tr[data-leader]")
    expect(leader_row).to_have_count(1)
    expect(leader_row).to_contain_text("(this one)")
    expect(leader_row).to_contain_text("active")
    page.screenshot(path=screenshot_dir / "overview.png", full_page=True)
    page.set_viewport_size({"width": 390, "height": 844})
    page.locator("#chart-requests canvas").wait_for()
    page.screenshot(path=screenshot_dir / "overview-phone.png", full_page=True)
    page.set_viewport_size({"width": 1280, "height": 800})

    # With the keyboard alone: the skip link, then Tab to the scope and choose a model.
    page.reload()
    page.locator("#chart-requests").wait_for()
    page.keyboard.press("Tab")
    expect(page.locator(".skip")).to_be_focused()
    for _ in range(20):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.id") == "overview-scope":
            break
    expect(page.locator("#overview-scope")).to_be_focused()
    page.wait_for_function(
        "document.querySelector('#overview-scope option[value=\"model:tiny\"]') !== null"
    )
    while page.evaluate("document.activeElement.value") != "model:tiny":
        page.keyboard.press("ArrowDown")
    expect(page.locator("#chart-requests-summary")).to_contain_text("requests: now")

    # The Cluster page with the keyboard: drain gpu-a (its deployment fits nowhere else, so
    # it is left and named), then uncordon it.
    page.get_by_role("link", name="Cluster").focus()
    page.keyboard.press("Enter")
    card = page.locator("article[aria-label='node gpu-a']")
    card.get_by_role("button", name="Drain node gpu-a").focus()
    page.keyboard.press("Enter")  # the confirmation is accepted (_page)
    expect(card.locator(".maintenance")).to_have_text("drained; 1 left", timeout=60_000)
    expect(card.locator(f"li[data-move='{deployment.group(0)}']")).to_contain_text(
        "fits nowhere else"
    )
    page.screenshot(path=screenshot_dir / "cluster-drained.png", full_page=True)
    uncordon = card.get_by_role("button", name="Uncordon node gpu-a")
    uncordon.focus()
    page.keyboard.press("Enter")
    expect(card.locator(".maintenance")).to_have_count(0)
    assert cluster.node(cluster.agents["gpu-a"].node_id)["maintenance"] is None
    cluster.berth("stop", deployment.group(0))
    assert errors == []
    context.close()


def _write_peft_adapter(folder: Path) -> Path:
    """A minimal PEFT LoRA folder: its config and a safetensors header naming one lora_A."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": 4, "target_modules": ["q_proj", "v_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    header = json.dumps({name: {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 0]}})
    raw = header.encode()
    (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return folder


def test_an_operator_pulls_adds_an_adapter_and_edits_limits_and_scaling(
    console_leader: tuple[Cluster, str],
    chromium_browser: Any,
    hub: HubStandin,
    screenshot_dir: Path,
) -> None:
    from playwright.sync_api import expect

    cluster, admin_key = console_leader
    context, page, errors = _page(chromium_browser)
    _sign_in(page, cluster.base_url, admin_key)
    page.get_by_text("signed in as operator").wait_for()

    # Models: pull from the hub stand-in, with the keyboard; its second file is held half
    # sent, so the job shows while it downloads, then reaches done and the model is listed.
    page.get_by_role("link", name="Models").click()
    gate = hub.stall("org/tiny", "tiny.gguf")
    try:
        page.get_by_label("Hub repository").fill("org/tiny")
        page.get_by_label("Register as").fill("hub-tiny")
        page.get_by_label("Register as").press("Enter")
        job = page.locator("tr[data-pull]").filter(has_text="org/tiny")
        expect(job.locator(".pull-state")).to_contain_text("downloading")
        expect(job.locator(".pull-progress")).to_contain_text("now: tiny.gguf")
        page.screenshot(path=screenshot_dir / "models-pull.png", full_page=True)
    finally:
        gate.set()
    expect(job).to_have_attribute("data-state", "done", timeout=60_000)
    expect(job.locator("progress")).to_have_attribute("value", "100")
    expect(job.locator(".pull-state")).to_contain_text("done (model)")
    pulled = page.locator("tr[data-model='hub-tiny']")
    expect(pulled).to_contain_text("hub: org/tiny")  # the list refreshed by itself
    # A second pull under a taken name is refused at once, in plain words.
    page.get_by_label("Hub repository").fill("org/tiny-remote")
    page.get_by_label("Register as").fill("hub-tiny")
    page.get_by_role("button", name="Pull", exact=True).click()
    expect(page.locator("#page-error")).to_have_text(
        "a model or adapter named 'hub-tiny' already exists"
    )

    # Adapters: add one of model tiny from a folder on the leader's host, then remove it.
    adapter = _write_peft_adapter(cluster.root / "adapters" / "tiny-lora")
    page.get_by_label("Adapter name").fill("tiny-lora")
    page.get_by_label("Base model").select_option("tiny")
    page.get_by_label("Adapter path").fill(str(adapter))
    page.get_by_role("button", name="Add adapter").click()
    row = page.locator("tr[data-adapter='tiny-lora']")
    expect(row).to_contain_text("tiny")
    expect(row).to_contain_text(str(adapter.resolve()))
    expect(row.locator(".loaded")).to_have_text("not loaded")
    page.screenshot(path=screenshot_dir / "models.png", full_page=True)
    page.set_viewport_size({"width": 390, "height": 844})
    page.screenshot(path=screenshot_dir / "models-phone.png", full_page=True)
    page.set_viewport_size({"width": 1280, "height": 800})
    page.get_by_role("button", name="Remove adapter tiny-lora").click()
    expect(row).to_have_count(0)
    assert [a["name"] for a in cluster.admin("GET", "/admin/adapters")] == []

    # Keys: edit a key's limits; the API's refusal shows in the form, a good value in the list.
    cluster.admin("POST", "/admin/keys", json={"name": "limited"})
    page.get_by_role("link", name="Keys").click()
    page.get_by_role("button", name="Edit limits of limited").click()
    page.get_by_label("Tokens per day").fill(str(10**16))
    page.get_by_role("button", name="Save limits").click()
    expect(page.locator("#key-edit-error")).to_contain_text("daily_tokens")
    page.get_by_label("Tokens per day").fill("50000")
    page.get_by_label("Requests per minute").fill("42")
    page.screenshot(path=screenshot_dir / "keys-edit.png", full_page=True)
    page.get_by_role("button", name="Save limits").click()
    page.locator("#key-edit-done").wait_for()
    key_row = page.locator("tr[data-key='limited']")
    expect(key_row.locator(".limits")).to_contain_text("42 rpm*")
    expect(key_row.locator(".limits")).to_contain_text("50000 tokens/day*")
    (limited,) = [k for k in cluster.admin("GET", "/admin/keys") if k["name"] == "limited"]
    assert limited["limits"]["rpm"] == 42 and limited["limits"]["daily_tokens"] == 50000

    # Usage: the window and the grouping are chosen in the page.
    today = cluster.admin("GET", "/admin/usage?since=1d")["until"]
    page.get_by_label("Window (UTC days)").select_option("1d")
    expect(page.locator("#usage-total")).to_contain_text(f"{today} to {today}:")
    page.get_by_label("Group by").select_option("model")
    page.locator("#usage-by-model").wait_for()
    expect(page.locator("#usage-by-key")).to_have_count(0)
    page.get_by_label("Window (UTC days)").select_option("90d")
    expect(page.locator("#usage-total")).not_to_contain_text(f"{today} to {today}:")

    # Services: change a service's scaling settings; a refused change says why.
    cluster.admin("POST", "/admin/services", json={"name": "edit-svc", "model": "tiny"})
    page.get_by_role("link", name="Services").click()
    page.get_by_role("button", name="Edit scaling of edit-svc").click()
    page.get_by_label("Min replicas").fill("5")
    page.get_by_role("button", name="Save scaling").click()
    expect(page.locator("#service-edit-error")).not_to_be_empty()
    page.get_by_label("Min replicas").fill("0")
    page.get_by_label("Max replicas").fill("3")
    page.get_by_label("Idle timeout").fill("5m")
    page.get_by_role("button", name="Save scaling").click()
    page.locator("#service-edit-done").wait_for()
    service_row = page.locator("tr[data-service='edit-svc']")
    expect(service_row.locator(".replicas")).to_contain_text("(min 0, max 3)")
    expect(service_row.locator(".scaling")).to_contain_text("idle out after 5m")
    scaling = cluster.admin("GET", "/admin/services/edit-svc")["scaling"]
    assert scaling["max_replicas"] == 3 and scaling["idle_timeout_s"] == 300
    page.get_by_role("button", name="Edit scaling of edit-svc").click()
    page.screenshot(path=screenshot_dir / "services-edit.png", full_page=True)
    page.set_viewport_size({"width": 390, "height": 844})
    page.screenshot(path=screenshot_dir / "services-edit-phone.png", full_page=True)
    cluster.admin("DELETE", "/admin/services/edit-svc")
    # Chromium logs each refused call the test made on purpose (409 pull, 400 key, 400
    # service) as a failed resource load; nothing else may show up.
    refused = re.compile(
        r"^Failed to load resource: the server responded with a status of (409|400) .* at "
        r"\{'url': 'https://[^/]+/admin/(pulls|keys/[^']+|services/edit-svc)'"
    )
    assert [e for e in errors if not refused.match(e)] == []
    assert len(errors) == 3, errors
    context.close()


def test_a_standard_key_cannot_sign_in(
    console_leader: tuple[Cluster, str], chromium_browser: Any
) -> None:
    """With the keyboard alone: the key field has the focus, Enter sends it."""
    cluster, _ = console_leader
    context, page, _errors = _page(chromium_browser)
    page.goto(cluster.base_url + "/ui/")
    page.get_by_label("Admin key").wait_for()
    page.wait_for_function("document.activeElement && document.activeElement.id === 'signin-key'")
    page.keyboard.type(cluster.api_key)
    page.keyboard.press("Enter")
    page.get_by_role("alert").get_by_text("the console needs an admin key").wait_for()
    assert page.locator("#app").is_hidden()
    assert not [c for c in context.cookies() if c["name"] == "berth_session"]
    context.close()


def test_the_console_hides_what_the_keys_role_cannot_do(
    console_leader: tuple[Cluster, str], chromium_browser: Any
) -> None:
    """A viewer sees every page but no control that changes anything; an operator sees those
    of its role but not enrollment or an admin key's; the API refuses a hidden call anyway."""
    from playwright.sync_api import expect

    cluster, _ = console_leader
    keys = {
        role: cluster.admin("POST", "/admin/keys",
                            json={"name": f"{role}-{os.getpid()}", "tier": "admin", "role": role})
        for role in ("viewer", "operator")
    }  # fmt: skip
    watcher = keys["viewer"]["name"]

    context, page, errors = _page(chromium_browser)
    _sign_in(page, cluster.base_url, keys["viewer"]["secret"])
    page.get_by_text(f"signed in as {watcher} (viewer)").wait_for()
    page.get_by_role("link", name="Cluster").click()
    expect(page.locator("article.node").first).to_be_visible()
    expect(page.locator("article.node .actions").first).to_be_hidden()  # no cordon, no drain
    expect(page.locator("#enroll-label")).to_have_count(1)
    expect(page.locator("#enroll-label")).to_be_hidden()
    page.get_by_role("link", name="Deployments").click()
    expect(page.locator("#deploy-model")).to_have_count(1)
    expect(page.locator("#deploy-model")).to_be_hidden()
    page.get_by_role("link", name="Models").click()
    expect(page.locator("tr[data-model='tiny']")).to_be_visible()
    expect(page.locator("button[aria-label='Remove model tiny']")).to_have_count(1)
    expect(page.locator("button[aria-label='Remove model tiny']")).to_be_hidden()
    expect(page.locator("#pull-repo")).to_be_hidden()
    page.get_by_role("link", name="Keys").click()
    expect(page.locator(f"tr[data-key='{watcher}']")).to_be_visible()
    expect(page.locator("#key-name")).to_be_hidden()
    expect(page.locator(f"tr[data-key='{watcher}'] button")).to_have_count(2)
    expect(page.locator(f"tr[data-key='{watcher}'] button").first).to_be_hidden()
    assert not errors, errors  # no page asked for what the role may not have
    # What the page hides, the API refuses (the session's own CSRF token, from the page).
    refused = page.evaluate(
        """async () => {
          const answer = await fetch('/admin/models/tiny',
            { method: 'DELETE', headers: { 'x-csrf-token': state.csrf } });
          return [answer.status, (await answer.json()).error.code];
        }"""
    )
    assert refused == [403, "role_too_low"]
    context.close()

    context, page, errors = _page(chromium_browser)
    _sign_in(page, cluster.base_url, keys["operator"]["secret"])
    page.get_by_text("(operator)").wait_for()
    page.get_by_role("link", name="Cluster").click()
    expect(page.locator("article.node .actions").first).to_be_visible()
    expect(page.locator("#enroll-label")).to_have_count(1)
    expect(page.locator("#enroll-label")).to_be_hidden()  # enrolling a node is an admin's
    page.get_by_role("link", name="Keys").click()
    expect(page.locator("#key-name")).to_be_visible()
    expect(page.locator("tr[data-key='tests'] button").first).to_be_visible()  # a standard key
    expect(page.locator(f"tr[data-key='{watcher}'] button").first).to_be_hidden()  # an admin's
    assert not errors, errors
    context.close()
    for created in keys.values():
        cluster.admin("DELETE", f"/admin/keys/{created['id']}")


def test_the_session_needs_its_csrf_token_and_ends_with_its_key(
    console_leader: tuple[Cluster, str],
) -> None:
    cluster, _ = console_leader
    created = cluster.admin("POST", "/admin/keys", json={"name": "short-lived", "tier": "admin"})
    with httpx.Client(base_url=cluster.base_url, verify=cluster.tls(), timeout=30) as http:
        signed_in = http.post("/ui/session", json={"key": created["secret"]})
        assert signed_in.status_code == 201
        token = signed_in.json()["csrf_token"]
        # httpx keeps Secure cookies over https: the session rides along from here on.
        assert http.get("/admin/nodes").status_code == 200
        refused = http.post("/admin/keys", json={"name": "sneaky"})
        assert refused.status_code == 403
        assert "x-csrf-token" in refused.json()["error"]["message"]
        allowed = http.post("/admin/keys", json={"name": "fine"}, headers={"x-csrf-token": token})
        assert allowed.status_code == 201
        cluster.admin("DELETE", f"/admin/keys/{created['id']}")
        assert http.get("/admin/nodes").status_code == 401
        assert http.get("/ui/session").json() == {"signed_in": False, "session": None}


def test_a_leader_that_goes_away_shows_as_disconnected_and_comes_back(
    console_leader: tuple[Cluster, str], chromium_browser: Any
) -> None:
    """Last in the module: it restarts the leader."""
    cluster, admin_key = console_leader
    context, page, _errors = _page(chromium_browser)
    _sign_in(page, cluster.base_url, admin_key)
    page.get_by_role("link", name="Cluster").click()
    page.locator("article[aria-label='node gpu-a']").wait_for()
    cluster.berth("daemon", "stop")
    page.get_by_text("Disconnected from the leader").wait_for()
    cluster.start()
    # Sessions live in the leader's memory: the page notices the new leader by itself and
    # asks to sign in again, and the key still works.
    page.get_by_text("Your session has ended").wait_for()
    assert page.locator("#banner").is_hidden()
    page.get_by_label("Admin key").fill(admin_key)
    page.get_by_role("button", name="Sign in").click()
    page.locator("article[aria-label='node local']").wait_for()
    context.close()
