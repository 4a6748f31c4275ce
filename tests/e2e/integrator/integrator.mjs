// A third-party integrator of Dilu's bus, written as one would from docs/events.md alone: it connects
// with the integrator credentials, subscribes to every event subject pattern, validates each message
// (JSON Schema of its event type with ajv, CloudEvents headers), then checks that it may not publish.
//
// usage: node integrator.mjs CONFIG.json
//   CONFIG = {"url": "nats://...", "creds": "D/creds/integrator.creds",
//             "subjects": {"<pattern>": {"type": "<Event>", "schema": "/path/<Event>.json"}},
//             "publish": [{"subject": "...", "type": "<Event>", "payload": {...}}]}
//   (DILU_NATS_URL and DILU_NATS_CREDS override "url" and "creds".)
// stdout: {"subscribed": N} once every subscription is in place; then, when stdin closes, it tries each
// "publish", waits for the server's verdict and prints one JSON summary line.
// exit: 0 when every event was valid and every publish refused; 1 on any invalid event; 3 when a
// publish was not refused; 2 on a bad configuration or connection.
import { readFileSync } from "node:fs";
import { connect, nkeyAuthenticator, credsAuthenticator, headers as natsHeaders, Events } from "nats";
import Ajv2020 from "ajv/dist/2020.js";

const CE_HEADERS = ["ce-specversion", "ce-type", "ce-source", "ce-id", "ce-time", "content-type"];
const RFC3339 = /^(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?(Z|[+-]\d{2}:\d{2})$/;
const MAX_LISTED = 50; // invalid messages listed in the summary (all are counted)
const VERDICT_WAIT_MS = 3000; // how long to wait for the server to refuse a publish

function fail(msg) {
  process.stderr.write(`integrator: ${msg}\n`);
  process.exit(2);
}

/** The authenticator for a creds file: a JWT .creds file, or a user nkey seed (bare or between
 *  BEGIN/END USER NKEY SEED lines). */
function authenticator(path) {
  const text = readFileSync(path, "utf8");
  if (text.includes("BEGIN NATS USER JWT")) return credsAuthenticator(new TextEncoder().encode(text));
  const m = text.match(/^\s*(SU[A-Z2-7]{40,})\s*$/m);
  if (!m) fail(`${path}: no user nkey seed (SU...) in it`);
  return nkeyAuthenticator(new TextEncoder().encode(m[1]));
}

/** Does NATS subject `subject` match `pattern` ('*' = one token, '>' = the rest)? */
function matches(pattern, subject) {
  const p = pattern.split("."), s = subject.split(".");
  for (let i = 0; i < p.length; i++) {
    if (p[i] === ">") return s.length > i;
    if (i >= s.length || (p[i] !== "*" && p[i] !== s[i])) return false;
  }
  return p.length === s.length;
}

/** RFC 3339 time -> Unix epoch ns (BigInt), or null when it is not one. */
function epochNs(value) {
  const m = RFC3339.exec(value);
  if (!m) return null;
  const ms = Date.parse(m[1] + m[3]);
  if (Number.isNaN(ms)) return null;
  return BigInt(ms) * 1000000n + BigInt((m[2] || "").padEnd(9, "0") || "0");
}

const config = JSON.parse(readFileSync(process.argv[2] || fail("usage: integrator.mjs CONFIG.json"), "utf8"));
const url = process.env.DILU_NATS_URL || config.url;
const credsPath = process.env.DILU_NATS_CREDS || config.creds;
if (!url) fail("no NATS URL (config.url or DILU_NATS_URL)");

const ajv = new Ajv2020({ allErrors: true, strict: true });
const patterns = Object.entries(config.subjects).map(([pattern, { type, schema }]) => ({
  pattern, type, validate: ajv.compile(JSON.parse(readFileSync(schema, "utf8"))),
}));

const counts = {}, sources = {}, invalid = [], seenIds = new Set(), statusErrors = [];
let invalidCount = 0;

function check(sub, msg) {
  const reasons = [];
  const hits = patterns.filter((p) => matches(p.pattern, msg.subject));
  if (hits.length !== 1) reasons.push(`subject matches ${hits.length} event patterns, expected 1`);
  else if (hits[0].pattern !== sub.pattern) reasons.push(`subject matches ${hits[0].pattern}, delivered on ${sub.pattern}`);
  const { type, validate } = hits[0] || sub;
  counts[type] = (counts[type] || 0) + 1;

  let event = null;
  try {
    event = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(msg.data));
  } catch (e) {
    reasons.push(`payload is not UTF-8 JSON: ${e.message}`);
  }
  if (event !== null && !validate(event)) {
    for (const e of validate.errors) reasons.push(`schema: ${e.instancePath || "$"} ${e.message}`);
  }

  const h = msg.headers;
  const get = (k) => (h ? h.get(k) : "");
  if (!h) reasons.push("no headers");
  for (const k of CE_HEADERS) if (h && !h.has(k)) reasons.push(`header ${k} missing`);
  if (h) {
    if (get("ce-specversion") !== "1.0") reasons.push(`ce-specversion ${JSON.stringify(get("ce-specversion"))} != "1.0"`);
    if (get("ce-type") !== `io.dilu.v1.${type}`) reasons.push(`ce-type ${JSON.stringify(get("ce-type"))} != "io.dilu.v1.${type}"`);
    const src = get("ce-source");
    if (!src) reasons.push("ce-source empty");
    else (sources[type] ||= new Set()).add(src);
    const id = get("ce-id");
    if (!id) reasons.push("ce-id empty");
    else if (seenIds.has(id)) reasons.push(`ce-id ${id} seen before`);
    else seenIds.add(id);
    const t = epochNs(get("ce-time"));
    if (t === null) reasons.push(`ce-time ${JSON.stringify(get("ce-time"))} is not an RFC 3339 time`);
    else if (event && Number.isInteger(event.ts_ns) && event.ts_ns > 0) {
      // ts_ns (about 1.8e18) is read as a double: equal within its precision (256 ns) and then some
      const diff = t - BigInt(event.ts_ns);
      if (diff > 1000n || diff < -1000n) reasons.push(`ce-time ${get("ce-time")} is ${diff} ns from ts_ns ${event.ts_ns}`);
    }
    if (get("content-type") !== "application/json") reasons.push(`content-type ${JSON.stringify(get("content-type"))} != "application/json"`);
  }
  if (reasons.length) {
    invalidCount++;
    if (invalid.length < MAX_LISTED) invalid.push({ subject: msg.subject, type, reasons });
  }
}

let nc;
try {
  nc = await connect({ servers: url.split(","), name: "node-integrator", maxReconnectAttempts: 0,
                       ...(credsPath ? { authenticator: authenticator(credsPath) } : {}) });
} catch (e) {
  fail(`cannot connect to ${url}: ${e.message}`);
}

const refused = new Set();
let verdict = () => {};
(async () => {
  for await (const s of nc.status()) {
    if (s.type !== Events.Error) continue;
    const ctx = s.permissionContext;
    if (s.data === "PERMISSIONS_VIOLATION" && ctx && ctx.operation === "publish") {
      refused.add(ctx.subject);
      verdict();
    } else {
      statusErrors.push({ error: s.data, ...(ctx || {}) });
    }
  }
})();

for (const p of patterns) {
  const sub = nc.subscribe(p.pattern, {
    callback: (err, msg) => {
      if (err) statusErrors.push({ error: err.code || String(err), subscription: p.pattern });
      else check(p, msg);
    },
  });
  sub.closed.catch(() => {}); // a refused subscription is reported through status() and its callback
}
await nc.flush();
process.stdout.write(JSON.stringify({ subscribed: patterns.length }) + "\n");

// run until stdin closes (the test's demo is over)
process.stdin.resume();
await new Promise((resolve) => process.stdin.on("end", resolve).on("close", resolve));

const attempted = [];
for (const { subject, type, payload } of config.publish || []) {
  const now = Date.now(), h = natsHeaders();
  h.set("ce-specversion", "1.0");
  h.set("ce-type", `io.dilu.v1.${type}`);
  h.set("ce-source", "integrator/node");
  h.set("ce-id", `integrator-${now}-${attempted.length}`);
  h.set("ce-time", new Date(now).toISOString());
  h.set("content-type", "application/json");
  const event = { ...payload, ts_ns: now * 1e6 };
  nc.publish(subject, new TextEncoder().encode(JSON.stringify(event)), { headers: h });
  attempted.push(subject);
}
await nc.flush(); // also: every message the server sent before this is counted
const allRefused = () => attempted.every((s) => refused.has(s));
if (!allRefused()) {
  await new Promise((resolve) => {
    const timer = setTimeout(resolve, VERDICT_WAIT_MS);
    verdict = () => { if (allRefused()) { clearTimeout(timer); resolve(); } };
  });
}
await nc.flush();
await nc.close();

const publishRefused = attempted.length > 0 && allRefused();
const summary = {
  counts,
  total: Object.values(counts).reduce((a, b) => a + b, 0),
  invalid_count: invalidCount,
  invalid,
  sources: Object.fromEntries(Object.entries(sources).map(([k, v]) => [k, [...v].sort()])),
  publish: { attempted, refused: [...refused].sort() },
  publish_refused: publishRefused,
  errors: statusErrors,
};
process.stdout.write(JSON.stringify(summary) + "\n");
process.exit(invalidCount ? 1 : publishRefused ? 0 : 3);
