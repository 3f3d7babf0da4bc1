// clef-serve's status page: /status every 5 seconds, and a form that sends one decision to /v1/systemone.
// Everything is built with textContent (nothing the server or a client sent is parsed as HTML); the API key is read
// from its field when a decision is sent and kept nowhere else (no storage, no cookie, no URL).
"use strict";

const REFRESH_MS = 5000;
const EXAMPLE_STATE = [
  "09:12:01 INFO api: request served",
  "09:12:04 ERROR db: connection refused",
  "09:12:09 WARN cache: high latency",
  "09:12:15 ERROR queue: write failed",
].join("\n");
const EXAMPLE_QUESTIONS = {
  last_error: { type: "noul", instructions: "Is the last log line an ERROR?" },
  last_failure: {
    type: "choice",
    instructions: "Which component logged the latest ERROR?",
    criteria: { db: null, api: null, cache: null, queue: null, auth: null },
  },
  last_level: { type: "score", criteria: ["info", "warning", "error"] },
};

const $ = (id) => document.getElementById(id);

function element(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

function facts(list, pairs) {
  list.replaceChildren();
  for (const [name, value] of pairs) {
    list.append(element("dt", name), element("dd", value === null || value === undefined ? "-" : value));
  }
}

function milliseconds(value) {
  return value === null || value === undefined ? "-" : `${value.toFixed(1)} ms`;
}

function renderStatus(status) {
  const badge = $("readiness");
  badge.dataset.status = status.status;
  badge.textContent = status.ready ? "ready" : status.status.replace("_", " ");
  $("reason").textContent = status.ready ? "" : status.reason || "";
  $("served-model").textContent = status.served_model;
  if (!$("model-name").value) $("model-name").value = status.served_model;
  facts($("model-facts"), [
    ["served as", [status.served_model, ...status.aliases].join(", ")],
    ["model", status.model],
    ["device", status.device],
    ["dtype", status.dtype],
    ["int8 weights", status.quantize === "int8" ? "yes (W8A16)" : "no"],
    ["tensor parallel", status.tensor_parallel > 1 ? `${status.tensor_parallel} cards` : "no"],
    ["variants", status.variants.length ? status.variants.join(", ") : "none"],
  ]);
  const recent = status.recent;
  $("window-minutes").textContent = Math.round(recent.window_seconds / 60);
  const statuses = Object.entries(recent.by_status).map(([code, n]) => `${n} x ${code}`).join(", ");
  facts($("recent"), [
    ["decisions", `${recent.requests} (${recent.per_minute.toFixed(1)} a minute)`],
    ["statuses", statuses || "-"],
    ["latency p50 / p90 / p99", [recent.latency_ms.p50, recent.latency_ms.p90, recent.latency_ms.p99].map(milliseconds).join(" / ")],
    ["prefix-cache hits", recent.prefix_cache_hits === null ? "-" : `${recent.prefix_cache_hits} of ${recent.answered} answered`],
    ["input served from cache", recent.cached_token_share === null ? "-" : `${(100 * recent.cached_token_share).toFixed(1)}%`],
  ]);
  const shadow = status.shadow;
  facts($("shadow-facts"), shadow === null ? [["shadow", "not running"]] : [
    ["re-decided", shadow.verified],
    ["matched", shadow.match],
    ["marginal", shadow.marginal],
    ["mismatched", shadow.mismatch],
    ["dropped", shadow.dropped],
    ["sampled", `${(100 * shadow.rate).toFixed(1)}% of answered records`],
  ]);
  renderProgress(status.prefills, status.queued);
  renderSelfcheck(status.selfcheck);
  renderAutotune(status.autotune);
}

// The running records' prefill progress (a long record's takes minutes), one row each (data-request for tests).
function renderProgress(prefills, queued) {
  const body = $("progress-table").tBodies[0];
  body.replaceChildren();
  const waiting = queued ? `; ${queued} waiting` : "";
  $("progress-summary").textContent = prefills.length ? `${prefills.length} running${waiting}` : `nothing running${waiting}`;
  for (const p of prefills) {
    const row = element("tr");
    row.dataset.request = p.request_id;
    const share = p.tokens_total ? ` (${((100 * p.tokens_prefilled) / p.tokens_total).toFixed(0)}%)` : "";
    row.append(
      element("td", p.request_id),
      element("td", `${p.tokens_prefilled.toLocaleString("en-US")}${share}`),
      element("td", p.tokens_total.toLocaleString("en-US")),
      element("td", p.seconds.toFixed(1)),
    );
    body.append(row);
  }
}

function renderSelfcheck(report) {
  const body = $("selfcheck-table").tBodies[0];
  body.replaceChildren();
  if (report === null) {
    $("selfcheck-summary").textContent = "not run (loading, or --selfcheck off)";
    return;
  }
  const failed = Object.values(report.checks).filter((check) => !check.passed).length;
  $("selfcheck-summary").textContent =
    `${failed ? `FAILED ${failed} of` : "passed"} ${Object.keys(report.checks).length} checks on ${report.device} ${report.dtype}`;
  for (const [name, check] of Object.entries(report.checks)) {
    const row = element("tr");
    const error = check.max_abs_error === null ? "inf" : check.max_abs_error.toExponential(2);
    const verdict = element("td", check.passed ? "ok" : check.error || "FAILED", check.passed ? "" : "failed");
    row.append(element("td", name), element("td", error), element("td", check.tolerance.toExponential(2)), verdict);
    body.append(row);
  }
}

function renderAutotune(report) {
  const body = $("autotune-table").tBodies[0];
  body.replaceChildren();
  if (report === null) {
    $("autotune-summary").textContent = "off: each op runs the dispatch rule's kernel";
    return;
  }
  const failures = Object.keys(report.failures);
  $("autotune-summary").textContent =
    `${report.mode}, ${report.cached ? "from its cache" : `${report.seconds.toFixed(1)} s`}` +
    (failures.length ? `; failed here and never run: ${failures.join(", ")}` : "");
  for (const [op, buckets] of Object.entries(report.choices)) {
    for (const [bucket, implementation] of Object.entries(buckets)) {
      const row = element("tr");
      row.append(element("td", op), element("td", bucket), element("td", implementation));
      body.append(row);
    }
  }
}

async function refresh() {
  try {
    const response = await fetch("/status", { cache: "no-store" });
    renderStatus(await response.json());
  } catch (error) {
    const badge = $("readiness");
    badge.dataset.status = "unreachable";
    badge.textContent = "unreachable";
    $("reason").textContent = String(error);
  }
}

// One question's options and their probabilities, as bars (data-option and data-p for tests and tools).
function renderAnswer(id, answer) {
  const box = element("div", null, "question");
  box.dataset.question = id;
  let probabilities = answer.probabilities;
  let headline = "";
  if (answer.type === "noul") {
    probabilities = { true: answer.noul, false: 1 - answer.noul };
    headline = `p(true) = ${answer.noul}`;
  } else if (answer.type === "choice") {
    headline = `${answer.choice} (confidence ${answer.confidence})`;
  } else {
    headline = `score ${answer.score} (confidence ${answer.confidence})`;
  }
  box.append(element("h3", `${id}: ${headline}`));
  for (const [option, p] of Object.entries(probabilities)) {
    const row = element("div", null, "option");
    row.dataset.option = option;
    row.dataset.p = String(p);
    const label = answer.legend && answer.legend[option] !== undefined ? `${option}: ${answer.legend[option]}` : option;
    const bar = element("div", null, "bar");
    const fill = element("span");
    fill.style.width = `${Math.max(0, Math.min(1, p)) * 100}%`;
    bar.append(fill);
    row.append(element("span", label), bar, element("span", Number(p).toFixed(4), "value"));
    box.append(row);
  }
  return box;
}

function readImage(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(String(reader.result).split(",", 2)[1]);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function showError(text) {
  const box = $("decision-error");
  box.textContent = text;
  box.hidden = false;
}

async function decide(event) {
  event.preventDefault();
  $("decision-error").hidden = true;
  $("answers").replaceChildren();
  let questions;
  try {
    questions = JSON.parse($("questions").value);
  } catch (error) {
    showError(`the questions are not JSON: ${error.message}`);
    return;
  }
  const body = { model: $("model-name").value, state: $("state").value, questions };
  const files = Array.from($("images").files);
  if (files.length) body.images = await Promise.all(files.map(readImage));
  const headers = { "Content-Type": "application/json" };
  const key = $("api-key").value;
  if (key) headers.Authorization = `Bearer ${key}`;
  $("decide").disabled = true;
  try {
    const response = await fetch("/v1/systemone", { method: "POST", headers, body: JSON.stringify(body) });
    const result = await response.json();
    if (!response.ok) {
      const detail = result.detail;
      const message = Array.isArray(detail)
        ? detail.map((d) => `${(d.loc || []).join(".")}: ${d.msg}`).join("; ")
        : `${detail.error_type}: ${detail.message}`;
      showError(`${response.status} ${message}`);
      return;
    }
    for (const [id, answer] of Object.entries(result.answers)) $("answers").append(renderAnswer(id, answer));
    const usage = element("p", `${result.usage.input_tokens} input tokens, ${result.x_cached_tokens || 0} from the prefix cache`, "muted");
    $("answers").append(usage);
  } catch (error) {
    showError(String(error));
  } finally {
    $("decide").disabled = false;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("state").value = EXAMPLE_STATE;
  $("questions").value = JSON.stringify(EXAMPLE_QUESTIONS, null, 2);
  $("decision-form").addEventListener("submit", decide);
  refresh();
  setInterval(refresh, REFRESH_MS);
});
