//! The operators' dashboard and alert rules (`deploy/observability/`)
//! against a real router and a real Prometheus.
//!
//! - `promtool check rules` and `promtool test rules` (the unit tests in
//!   `alerts.test.yaml`: each alert fires on its series and not on others).
//! - A Prometheus (Debian's `prometheus` package) scrapes a running router
//!   every second and loads the rules, while streamed and non-streamed
//!   requests go through the router to two simulated engines (one of which
//!   refuses requests at first, so that some are retried). Then every
//!   query of the dashboard (template variables as `.*`, `$__rate_interval`
//!   as `1m`) and every alert expression is evaluated through the HTTP API:
//!   each must evaluate, name only metrics the router exports, and return
//!   series (the core panels values above 0); every rule is
//!   healthy, carries a severity, a summary, a description and a runbook
//!   section of docs/troubleshooting.md, and stays quiet while the router is
//!   healthy.
//! - Then the fleet breaks the way the alerts describe (lost KV events,
//!   every engine gone, 5xx answers, a pool naming a missing worker set) and
//!   the alerts for it go pending on the real router's metrics.
//!
//! A missing `prometheus` or `promtool` fails the test with how to install
//! them; it never skips.

mod support;

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kinference_sim::{FailMode, FaultRequest};
use serde_json::{Value, json};
use support::*;

const ADVICE: &str = "install Debian's prometheus package (`apt-get install prometheus`: it brings `prometheus` and `promtool`), or put both binaries on PATH";

/// Dashboard panels every query of which must return series with a value
/// above 0 after the traffic sent.
const CORE: &[&str] = &[
    "Request rate by code",
    "Time to first token vs predicted",
    "Tokens per second",
];

fn observability_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/observability")
}

fn workspace_file(path: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
}

/// Runs a Prometheus tool, failing loudly when it is not installed.
fn run_tool(tool: &str, args: &[&str], dir: &Path) -> String {
    let out = Command::new(tool)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {tool} ({e}): {ADVICE}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{tool} {}: {}\n{text}",
        args.join(" "),
        out.status
    );
    text
}

#[test]
fn promtool_checks_the_rules_and_runs_their_unit_tests() {
    let dir = observability_dir();
    let checked = run_tool("promtool", &["check", "rules", "alerts.yaml"], &dir);
    assert!(checked.contains("SUCCESS"), "{checked}");
    let tested = run_tool("promtool", &["test", "rules", "alerts.test.yaml"], &dir);
    assert!(tested.contains("SUCCESS"), "{tested}");
    // Every alert has a unit test.
    let rules = workspace_file("deploy/observability/alerts.yaml");
    let tests = workspace_file("deploy/observability/alerts.test.yaml");
    for name in alert_names(&rules) {
        assert!(
            tests.contains(&format!("alertname: {name}\n")),
            "alerts.test.yaml does not test {name}"
        );
    }
}

/// The `- alert: NAME` lines of a rule file.
fn alert_names(rules: &str) -> Vec<String> {
    rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .map(|s| s.trim().to_owned())
        .collect()
}

// ------------------------------------------------------------ Prometheus

/// A Prometheus server in a temporary directory, killed on drop.
struct Prometheus {
    child: Child,
    addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

impl Prometheus {
    /// Starts Prometheus scraping `target` every second, with the rules of
    /// `alerts.yaml` evaluated every second.
    fn start(target: SocketAddr) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let rules = observability_dir().join("alerts.yaml");
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: kinference-router\n    static_configs:\n      - targets: ['{target}']\n",
            rules.display()
        );
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config).expect("write prometheus.yml");
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port())
            .parse()
            .expect("address");
        let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log file");
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(log.try_clone().expect("log file"))
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start prometheus ({e}): {ADVICE}"));
        Prometheus { child, addr, dir }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    async fn wait_ready(&mut self) {
        let addr = self.addr;
        for _ in 0..150 {
            if let Some(status) = self.child.try_wait().expect("prometheus status") {
                panic!("prometheus exited ({status}):\n{}", self.log());
            }
            if try_get(addr, "/-/ready")
                .await
                .is_some_and(|(s, _)| s == 200)
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!("prometheus is not ready after 30 s:\n{}", self.log());
    }

    /// `/api/v1/query` at the current time: the whole answer, whatever its
    /// status.
    async fn query(&self, promql: &str) -> Value {
        let path = format!("/api/v1/query?query={}", encode(promql));
        let (_, body) = try_get(self.addr, &path)
            .await
            .unwrap_or_else(|| panic!("prometheus does not answer:\n{}", self.log()));
        serde_json::from_slice(&body).unwrap_or_else(|e| {
            panic!(
                "prometheus answered {promql:?} with no JSON ({e}): {}",
                String::from_utf8_lossy(&body)
            )
        })
    }

    /// The result vector of a query that must succeed.
    async fn vector(&self, promql: &str) -> Vec<Value> {
        let v = self.query(promql).await;
        assert_eq!(v["status"], "success", "{promql}: {v}");
        v["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// Every alerting rule Prometheus loaded.
    async fn rules(&self) -> Vec<Value> {
        let (_, body) = try_get(self.addr, "/api/v1/rules?type=alert")
            .await
            .expect("prometheus answers /api/v1/rules");
        let v: Value = serde_json::from_slice(&body).expect("rules JSON");
        v["data"]["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .collect()
    }

    async fn rule_state(&self, name: &str) -> String {
        self.rules()
            .await
            .iter()
            .find(|r| r["name"] == name)
            .and_then(|r| r["state"].as_str())
            .unwrap_or("missing")
            .to_owned()
    }
}

/// GET without panicking: (status, body), `None` when nothing answers.
async fn try_get(addr: SocketAddr, path: &str) -> Option<(u16, Bytes)> {
    let req = http::Request::get(format!("http://{addr}{path}"))
        .body(Full::new(Bytes::new()))
        .ok()?;
    let resp = client().request(req).await.ok()?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.ok()?.to_bytes();
    Some((status, body))
}

/// Percent-encodes a query parameter.
fn encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

// ------------------------------------------------------- metric names

/// The `kinference_router_*` names a PromQL expression reads.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = expr;
    while let Some(i) = rest.find("kinference_router_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        out.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    out
}

/// The series names the router's `/metrics` exposes: from its `# TYPE`
/// lines (so a family without series yet counts) and its samples.
fn exported_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        if let Some(t) = line.strip_prefix("# TYPE ") {
            let mut parts = t.split_whitespace();
            let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
                continue;
            };
            let suffixes: &[&str] = match kind {
                "counter" => &["_total"],
                "histogram" => &["_bucket", "_sum", "_count"],
                "info" => &["_info"],
                _ => &[""],
            };
            for s in suffixes {
                out.insert(format!("{name}{s}"));
            }
        } else if !line.starts_with('#') && !line.is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            out.insert(line[..end].to_owned());
        }
    }
    out
}

// ------------------------------------------------------- the dashboard

/// A dashboard query: (panel title, expression as written).
fn dashboard_queries(d: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().expect("panels") {
        if p["type"] == "row" {
            continue;
        }
        let title = p["title"].as_str().expect("a panel title").to_owned();
        assert_eq!(
            p["datasource"]["uid"], "${datasource}",
            "panel {title:?} does not use the datasource variable"
        );
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "panel {title:?} has no query");
        for t in targets {
            out.push((title.clone(), t["expr"].as_str().expect("expr").to_owned()));
        }
    }
    out
}

/// Replaces the dashboard's variables by what "All" means, and Grafana's
/// `$__rate_interval` by a window that holds many samples here.
fn substitute(expr: &str, vars: &[String]) -> String {
    let mut e = expr
        .replace("${__rate_interval}", "1m")
        .replace("$__rate_interval", "1m");
    for v in vars {
        e = e
            .replace(&format!("${{{v}}}"), ".*")
            .replace(&format!("${v}"), ".*");
    }
    assert!(!e.contains('$'), "an unknown variable in {expr}");
    e
}

/// Checks the dashboard's shape and returns its query variables.
fn check_dashboard_shape(d: &Value) -> Vec<(String, String)> {
    assert!(
        d["schemaVersion"].as_u64().is_some_and(|v| v >= 36),
        "schemaVersion {}",
        d["schemaVersion"]
    );
    let vars = d["templating"]["list"].as_array().expect("variables");
    let ds = vars
        .iter()
        .find(|v| v["name"] == "datasource")
        .expect("a datasource variable");
    assert_eq!(ds["type"], "datasource");
    assert_eq!(ds["query"], "prometheus");
    let mut out = Vec::new();
    for name in ["namespace", "pod", "model", "worker_set"] {
        let v = vars
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no {name} variable"));
        assert_eq!(v["type"], "query", "{name}");
        assert_eq!(v["datasource"]["uid"], "${datasource}", "{name}");
        let q = v["query"]["query"].as_str().expect("a variable query");
        assert!(q.starts_with("label_values("), "{name}: {q}");
        out.push((name.to_owned(), q.to_owned()));
    }
    out
}

// ------------------------------------------------------------ the test

/// Sends streamed and non-streamed chats and completions (with a shared
/// prefix, so some prompt tokens are cached), and one for an unknown model.
/// Returns how many requests were sent.
async fn traffic(r: &Router, round: usize) -> usize {
    let shared = words(0, 160);
    let mut n = 0;
    for k in 0..4 {
        let i = round * 100 + k;
        let content = format!("{shared} {}", words(10_000 + i * 50, 20));
        let reply = post(
            r.api(),
            "/v1/chat/completions",
            &chat(MODEL, &content, false, 8),
        )
        .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        let resp = post_streaming(
            r.api(),
            "/v1/chat/completions",
            &chat(MODEL, &format!("{content} again"), true, 16),
        )
        .await;
        assert_eq!(resp.status(), 200);
        let (ending, text) = read_stream(resp.into_body(), Duration::from_secs(20)).await;
        assert_eq!(ending, Ending::Complete, "{text}");
        let reply = post(
            r.api(),
            "/v1/completions",
            &json!({"model": ALIAS, "prompt": format!("{shared} {}", words(30_000 + i * 50, 10)), "max_tokens": 6}),
        )
        .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        n += 3;
    }
    let reply = post(
        r.api(),
        "/v1/chat/completions",
        &chat("no-such-model", "hello", false, 4),
    )
    .await;
    assert_eq!(reply.status, 404, "{}", reply.text());
    n + 1
}

async fn wait_state(prom: &Prometheus, alert: &str, state: &str) {
    eventually(
        Duration::from_secs(30),
        &format!("{alert} {state}"),
        || async {
            let now = prom.rule_state(alert).await;
            if now == state || (state == "pending" && now == "firing") {
                Ok(())
            } else {
                Err(format!("{alert} is {now}"))
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_evaluates_every_dashboard_query_and_alert_on_a_real_router() {
    let dashboard: Value =
        serde_json::from_str(&workspace_file("deploy/observability/dashboard.json"))
            .expect("dashboard.json is JSON");
    let variables = check_dashboard_shape(&dashboard);
    let var_names: Vec<String> = variables.iter().map(|(n, _)| n.clone()).collect();
    let queries = dashboard_queries(&dashboard);
    let troubleshooting = workspace_file("docs/troubleshooting.md");

    let sims = engines(2, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 2, true).await;

    let mut prom = Prometheus::start(r.admin());
    prom.wait_ready().await;
    // The first scrape, before any request, so that rates see the traffic.
    eventually(Duration::from_secs(30), "the first scrape", || async {
        (!prom.vector("kinference_router_build_info").await.is_empty()).then_some(())
    })
    .await;

    // First one engine refuses every request (admission control, 503):
    // they are retried on the other, so the retries panel has data (a
    // family without series is absent from /metrics) and no client sees an
    // error. Distinct prompts until one has been retried.
    sims[0]
        .inject(&FaultRequest {
            fail_requests: Some(FailMode::AdmissionReject),
            ..FaultRequest::default()
        })
        .await
        .expect("fault injected");
    let mut sent = 0;
    let api = r.api();
    let admin = r.admin();
    eventually(Duration::from_secs(20), "a retried request", || {
        sent += 1;
        let content = words(50_000 + sent * 40, 30);
        async move {
            let reply = post(
                api,
                "/v1/chat/completions",
                &chat(MODEL, &content, false, 4),
            )
            .await;
            assert_eq!(reply.status, 200, "{}", reply.text());
            let metrics = get(admin, "/metrics").await.text();
            metrics
                .contains("kinference_router_retries_total{")
                .then_some(())
        }
    })
    .await;
    sims[0]
        .inject(&FaultRequest {
            fail_requests: Some(FailMode::None),
            ..FaultRequest::default()
        })
        .await
        .expect("fault cleared");
    for round in 0..3 {
        sent += traffic(&r, round).await;
        tokio::time::sleep(Duration::from_millis(1200)).await;
    }
    eventually(
        Duration::from_secs(30),
        "Prometheus has scraped every request",
        || async {
            let v = prom.vector("sum(kinference_router_requests_total)").await;
            let seen = v
                .first()
                .and_then(|s| s["value"][1].as_str())
                .and_then(|x| x.parse::<f64>().ok())
                .unwrap_or(0.0);
            if seen >= sent as f64 {
                Ok(())
            } else {
                Err(format!("{seen} of {sent}"))
            }
        },
    )
    .await;
    // A few more samples after the last request.
    tokio::time::sleep(Duration::from_secs(3)).await;

    let exposition = get(r.admin(), "/metrics").await.text();
    let exported = exported_names(&exposition);
    let check_names = |what: &str, expr: &str| {
        let unknown: Vec<String> = metric_names(expr)
            .into_iter()
            .filter(|n| !exported.contains(n))
            .collect();
        assert!(
            unknown.is_empty(),
            "{what} reads {unknown:?}, which the router does not export; its metrics:\n{}",
            exported.iter().cloned().collect::<Vec<_>>().join("\n")
        );
    };

    // The template variables: their series exist.
    for (name, q) in &variables {
        let inner = q
            .strip_prefix("label_values(")
            .and_then(|s| s.rsplit_once(','))
            .map(|(m, _)| m.trim())
            .expect("label_values(series, label)");
        check_names(&format!("variable {name}"), inner);
        let series = prom.vector(&substitute(inner, &var_names)).await;
        assert!(!series.is_empty(), "variable {name}: {inner} has no series");
    }

    // Every panel query evaluates; all but the known-empty ones return
    // series; the core panels return values above 0.
    let mut report = String::new();
    let mut empty = Vec::new();
    for (title, expr) in &queries {
        check_names(&format!("panel {title:?}"), expr);
        let promql = substitute(expr, &var_names);
        let v = prom.query(&promql).await;
        assert_eq!(
            v["status"],
            "success",
            "panel {title:?}: {promql}\n{v}\n{}",
            prom.log()
        );
        let result = v["data"]["result"].as_array().cloned().unwrap_or_default();
        let values: Vec<f64> = result
            .iter()
            .filter_map(|s| s["value"][1].as_str()?.parse().ok())
            .collect();
        let _ = writeln!(report, "  {title}: {values:?} <- {promql}");
        if result.is_empty() {
            empty.push(title.clone());
        }
        if CORE.contains(&title.as_str()) {
            assert!(
                values.iter().any(|x| *x > 0.0),
                "core panel {title:?} shows nothing above 0: {promql} -> {v}"
            );
        }
    }
    eprintln!("dashboard queries against the router:\n{report}");
    assert!(
        empty.is_empty(),
        "panels with no data after the traffic sent: {empty:?}"
    );

    // Every alerting rule: loaded, described, evaluated without error, and
    // quiet while the router is healthy.
    let names = alert_names(&workspace_file("deploy/observability/alerts.yaml"));
    let rules = eventually(Duration::from_secs(30), "every rule evaluated", || async {
        let rules = prom.rules().await;
        let done = rules.len() == names.len()
            && rules.iter().all(|r| {
                r["lastEvaluation"]
                    .as_str()
                    .is_some_and(|t| !t.starts_with("0001"))
            });
        done.then_some(rules)
    })
    .await;
    for rule in &rules {
        let name = rule["name"].as_str().expect("a rule name");
        assert_eq!(rule["health"], "ok", "{name}: {rule}");
        assert!(
            ["critical", "warning"].contains(&rule["labels"]["severity"].as_str().unwrap_or("")),
            "{name}: severity {}",
            rule["labels"]["severity"]
        );
        for a in ["summary", "description", "runbook_url"] {
            assert!(
                rule["annotations"][a]
                    .as_str()
                    .is_some_and(|s| !s.is_empty()),
                "{name}: no {a}"
            );
        }
        let runbook = rule["annotations"]["runbook_url"].as_str().unwrap_or("");
        assert!(
            runbook.ends_with(&format!(
                "docs/troubleshooting.md#{}",
                name.to_ascii_lowercase()
            )),
            "{name}: runbook_url {runbook}"
        );
        assert!(
            troubleshooting.contains(&format!("\n## {name}\n")),
            "docs/troubleshooting.md has no section {name}"
        );
        let expr = rule["query"].as_str().expect("a rule query");
        check_names(&format!("alert {name}"), expr);
        prom.vector(expr).await;
        assert_eq!(
            rule["state"], "inactive",
            "{name} is {} on a healthy router: {}",
            rule["state"], rule["alerts"]
        );
    }

    // Events lost without replay: the index of those engines is stale.
    for s in &sims {
        s.inject(&FaultRequest {
            lose_batches: Some(2),
            ..FaultRequest::default()
        })
        .await
        .expect("fault injected");
    }
    for round in 10..12 {
        traffic(&r, round).await;
    }
    wait_state(&prom, "KinferenceKvIndexStale", "pending").await;

    // A pool that names a worker set that does not exist.
    let yaml = manifests_yaml(&addrs, &WorkerSetOpts::default()).replace(
        "workerSets: [{name: sim}]",
        "workerSets: [{name: sim}, {name: ghost}]",
    );
    assert!(yaml.contains("ghost"));
    write_manifests(r.dir.path(), &yaml);
    wait_state(&prom, "KinferenceConfigProblems", "pending").await;

    // Every engine gone: ejected, KV streams down while requests flowed,
    // and the requests sent now fail.
    for s in sims {
        s.shutdown().await;
    }
    eventually(Duration::from_secs(20), "both engines ejected", || async {
        let e = endpoints(&r).await;
        e["endpoints"]
            .as_array()?
            .iter()
            .all(|ep| ep["healthy"] == false)
            .then_some(())
    })
    .await;
    // Spread over scrapes: a counter's first sample is its baseline.
    for k in 0..12 {
        if k < 3 {
            tokio::time::sleep(Duration::from_millis(1200)).await;
        }
        let reply = post(
            r.api(),
            "/v1/chat/completions",
            &chat(MODEL, "anyone there?", false, 4),
        )
        .await;
        assert!(reply.status >= 500, "{} {}", reply.status, reply.text());
    }
    for alert in [
        "KinferenceWorkerSetAllEnginesEjected",
        "KinferenceNoKvEvents",
        "KinferenceHighErrorRatio",
    ] {
        wait_state(&prom, alert, "pending").await;
    }
    for rule in prom.rules().await {
        assert_eq!(rule["health"], "ok", "{rule}");
        eprintln!("{}: {}", rule["name"], rule["state"]);
    }

    drop(prom);
    r.shutdown().await;
}
