//! Figures of a run, and the outputs: a table on stdout, CSV, JSON and SVG
//! plots.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::drive::Sample;

mod plots;
mod tables;

pub(crate) use plots::plots;
pub(crate) use tables::{goals, markdown, step_costs, table, turns_kept_table};

/// Nearest-rank percentile of sorted values (NaN when empty).
pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (p * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

/// Median of values (mean of the two middle ones; NaN when empty).
pub(crate) fn median(values: &[f64]) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        f64::midpoint(v[n / 2 - 1], v[n / 2])
    }
}

/// JSON has no NaN: serde_json writes it as `null`; read `null` back as NaN.
fn f64_or_nan<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// A kinference router's learnt step costs at the end of a row
/// (`calibration.steps` in its `/debug/endpoints`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct StepCosts {
    pub overhead_ms: f64,
    pub decode_ms: f64,
    pub prefill_ms_per_token: f64,
    /// Streams fitted (with forgetting).
    pub samples: u64,
    /// Whether the router predicts with them.
    pub in_use: bool,
}

impl StepCosts {
    /// The first endpoint's fit in a `/debug/endpoints` body (every
    /// endpoint of a worker set shows the same).
    pub(crate) fn of_endpoints(body: &[u8]) -> Option<Self> {
        let v: serde_json::Value = serde_json::from_slice(body).ok()?;
        v["endpoints"]
            .as_array()?
            .iter()
            .find_map(|e| serde_json::from_value(e["calibration"]["steps"].clone()).ok())
    }
}

/// One (workload, rate, policy, repeat) run's figures.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Row {
    pub workload: String,
    /// Offered rate, requests per second.
    #[serde(deserialize_with = "f64_or_nan")]
    pub rate: f64,
    /// Rate ÷ the workload's knee.
    #[serde(deserialize_with = "f64_or_nan")]
    pub load: f64,
    pub policy: String,
    pub repeat: u32,
    /// Requests in the measured window.
    pub requests: usize,
    pub ok: usize,
    /// Still running at the drain deadline (their TTFT counts as the time
    /// waited, a lower bound).
    pub gave_up: usize,
    /// Multi-turn turns sent late because their conversation's previous
    /// turn was still running.
    pub late: usize,
    /// Prefix-cache hit rate over the window, from the engines' counters.
    #[serde(deserialize_with = "f64_or_nan")]
    pub hit_rate: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub ttft_p50_ms: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub ttft_p90_ms: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub ttft_p99_ms: f64,
    /// Inter-token latency: per request (last − first chunk) ÷ (chunks − 1),
    /// median and p90 over requests.
    #[serde(deserialize_with = "f64_or_nan")]
    pub itl_p50_ms: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub itl_p90_ms: f64,
    /// Completed requests per second over the window (to the last completion).
    #[serde(deserialize_with = "f64_or_nan")]
    pub req_per_s: f64,
    /// Streamed (scaled) tokens per second over the window.
    #[serde(deserialize_with = "f64_or_nan")]
    pub tokens_per_s: f64,
    /// Router CPU (user + system) per measured request, µs; NaN for the
    /// greedy-truth reference (no router).
    #[serde(deserialize_with = "f64_or_nan")]
    pub router_cpu_us_per_req: f64,
    /// Requests per engine, most loaded ÷ mean (1 = even).
    #[serde(deserialize_with = "f64_or_nan")]
    pub imbalance: f64,
    /// The workload's physical floor at this rate (see `super::floor`):
    /// TTFT percentiles over the measured arrivals, ms.
    #[serde(default = "nan", deserialize_with = "f64_or_nan")]
    pub floor_p50_ms: f64,
    #[serde(default = "nan", deserialize_with = "f64_or_nan")]
    pub floor_p90_ms: f64,
    #[serde(default = "nan", deserialize_with = "f64_or_nan")]
    pub floor_p99_ms: f64,
    /// Hash of every request body sent, in plan order: equal across policies
    /// when they replayed identical streams.
    pub fingerprint: String,
    /// Measured requests served with a TTFT within [`GOODPUT_TTFT_MS`].
    #[serde(default)]
    pub good: usize,
    /// `good` per second of the measured window (goodput).
    #[serde(default = "nan", deserialize_with = "f64_or_nan")]
    pub goodput_per_s: f64,
    /// The slowest engine's share of the requests, when one is slower
    /// (slow-burst); NaN otherwise.
    #[serde(default = "nan", deserialize_with = "f64_or_nan")]
    pub slow_share: f64,
    /// Of the measured follow-up turns of conversations (labels `cXtY`,
    /// `Y > 0`) whose engine and previous turn's engine are known, the
    /// share sent to the engine of the turn before; NaN when there are
    /// none (other workloads, routers that do not name engines).
    #[serde(default = "nan", deserialize_with = "f64_or_nan")]
    pub turns_kept: f64,
    /// Measured requests that ended in an error: no first token (`lost`)
    /// or cut after it (`cut`); a request still running at the drain
    /// deadline is neither.
    #[serde(default)]
    pub lost: usize,
    #[serde(default)]
    pub cut: usize,
    /// A kill row's: from the kill until every surviving replica stopped
    /// counting the killed one's load (`kinference_router_peers_reporting`),
    /// ms; NaN elsewhere.
    #[serde(default = "nan", deserialize_with = "f64_or_nan")]
    pub absorb_ms: f64,
    /// The two-tenant scenario's figures, per tenant and phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenants: Option<TenantFigures>,
    /// The LoRA workload's figures: base-model and adapter requests apart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraFigures>,
    /// Router replicas' rows: bytes of load polls between replicas per
    /// measured request (every replica's received, HTTP/1.1 messages), and
    /// bytes of KV index snapshots in the window; NaN elsewhere.
    #[serde(default = "nan", deserialize_with = "f64_or_nan")]
    pub peer_bytes_per_req: f64,
    #[serde(default = "nan", deserialize_with = "f64_or_nan")]
    pub snapshot_bytes: f64,
    /// A join row's late replica: from its start to ready (ms), its hit
    /// rate over its first [`super::routing::JOIN_WINDOW`] and its peers'
    /// over the same interval, the requests it answered then, and its
    /// bootstrap's state (`seeded`, `fallback`; empty when off).
    #[serde(default = "nan", deserialize_with = "f64_or_nan")]
    pub join_ready_ms: f64,
    #[serde(default = "nan", deserialize_with = "f64_or_nan")]
    pub join_hit_rate: f64,
    #[serde(default = "nan", deserialize_with = "f64_or_nan")]
    pub join_peers_hit_rate: f64,
    #[serde(default)]
    pub join_requests: usize,
    /// TTFT p90 (ms) of the late replica's requests over the same window,
    /// and of its peers'.
    #[serde(default = "nan", deserialize_with = "f64_or_nan")]
    pub join_ttft_p90_ms: f64,
    #[serde(default = "nan", deserialize_with = "f64_or_nan")]
    pub join_peers_ttft_p90_ms: f64,
    #[serde(default)]
    pub join_bootstrap: String,
    /// Each kinference router's learnt step costs at the end, in replica
    /// order (the first repeat's, in medians).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub step_costs: Vec<StepCosts>,
}

/// The two-tenant scenario: the light tenant alone and with the heavy one,
/// and the heavy one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct TenantFigures {
    pub light_alone: Share,
    pub light_with_heavy: Share,
    pub heavy: Share,
}

/// One tenant's requests in one phase.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Share {
    pub requests: usize,
    /// Completed.
    pub ok: usize,
    /// Answered without a first token (the router's 429s).
    pub refused: usize,
    #[serde(deserialize_with = "f64_or_nan")]
    pub ttft_p50_ms: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub ttft_p90_ms: f64,
}

impl Share {
    /// The figures of the samples whose label starts with `prefix`.
    pub(crate) fn of(samples: &[Sample], prefix: &str) -> Self {
        Self::of_these(
            &samples
                .iter()
                .filter(|s| s.label.starts_with(prefix))
                .collect::<Vec<_>>(),
        )
    }

    fn of_these(mine: &[&Sample]) -> Self {
        let mut ttft: Vec<f64> = mine
            .iter()
            .filter(|s| s.ok)
            .filter_map(|s| s.ttft)
            .map(|d| d.as_secs_f64() * 1e3)
            .collect();
        ttft.sort_by(f64::total_cmp);
        Self {
            requests: mine.len(),
            ok: mine.iter().filter(|s| s.ok).count(),
            refused: mine
                .iter()
                .filter(|s| !s.ok && !s.gave_up && s.ttft.is_none())
                .count(),
            ttft_p50_ms: percentile(&ttft, 0.5),
            ttft_p90_ms: percentile(&ttft, 0.9),
        }
    }

    fn median_of(shares: &[Self]) -> Self {
        let m = |f: fn(&Self) -> f64| median(&shares.iter().map(f).collect::<Vec<_>>());
        Self {
            requests: m(|s| s.requests as f64).round() as usize,
            ok: m(|s| s.ok as f64).round() as usize,
            refused: m(|s| s.refused as f64).round() as usize,
            ttft_p50_ms: m(|s| s.ttft_p50_ms),
            ttft_p90_ms: m(|s| s.ttft_p90_ms),
        }
    }
}

impl std::fmt::Display for TenantFigures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "light tenant TTFT p90 alone {:.0} ms, with the heavy one {:.0} ms ({:.2}×, {}/{} ok); heavy p90 {:.0} ms, {}/{} ok, {} refused",
            self.light_alone.ttft_p90_ms,
            self.light_with_heavy.ttft_p90_ms,
            self.ratio(),
            self.light_with_heavy.ok,
            self.light_with_heavy.requests,
            self.heavy.ttft_p90_ms,
            self.heavy.ok,
            self.heavy.requests,
            self.heavy.refused
        )
    }
}

impl TenantFigures {
    /// The light tenant's TTFT p90 with the heavy one ÷ alone.
    pub(crate) fn ratio(&self) -> f64 {
        self.light_with_heavy.ttft_p90_ms / self.light_alone.ttft_p90_ms
    }

    fn median_of(rows: &[&Row]) -> Option<Self> {
        let all: Vec<&Self> = rows.iter().filter_map(|r| r.tenants.as_ref()).collect();
        if all.is_empty() {
            return None;
        }
        let of =
            |f: fn(&Self) -> Share| Share::median_of(&all.iter().map(|t| f(t)).collect::<Vec<_>>());
        Some(Self {
            light_alone: of(|t| t.light_alone),
            light_with_heavy: of(|t| t.light_with_heavy),
            heavy: of(|t| t.heavy),
        })
    }
}

/// The LoRA workload: its measured requests to the base model and to the
/// adapters, apart.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct LoraFigures {
    pub base: Share,
    pub adapters: Share,
}

impl LoraFigures {
    /// The measured samples' figures, by label (see
    /// [`super::workload::LORA_BASE_LABEL`]).
    pub(crate) fn of(samples: &[Sample]) -> Self {
        use super::workload::{LORA_ADAPTER_LABEL, LORA_BASE_LABEL};
        let class = |prefix: &str| {
            Share::of_these(
                &samples
                    .iter()
                    .filter(|s| s.measured && s.label.starts_with(prefix))
                    .collect::<Vec<_>>(),
            )
        };
        Self {
            base: class(LORA_BASE_LABEL),
            adapters: class(LORA_ADAPTER_LABEL),
        }
    }

    /// The adapters' TTFT p90 ÷ the base model's.
    pub(crate) fn ratio(&self) -> f64 {
        self.adapters.ttft_p90_ms / self.base.ttft_p90_ms
    }

    fn median_of(rows: &[&Row]) -> Option<Self> {
        let all: Vec<&Self> = rows.iter().filter_map(|r| r.lora.as_ref()).collect();
        if all.is_empty() {
            return None;
        }
        let of =
            |f: fn(&Self) -> Share| Share::median_of(&all.iter().map(|t| f(t)).collect::<Vec<_>>());
        Some(Self {
            base: of(|t| t.base),
            adapters: of(|t| t.adapters),
        })
    }
}

impl std::fmt::Display for LoraFigures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "base model TTFT p50 {:.0} p90 {:.0} ms ({}/{} ok); adapters p50 {:.0} p90 {:.0} ms ({}/{} ok), p90 {:.2}× the base's",
            self.base.ttft_p50_ms,
            self.base.ttft_p90_ms,
            self.base.ok,
            self.base.requests,
            self.adapters.ttft_p50_ms,
            self.adapters.ttft_p90_ms,
            self.adapters.ok,
            self.adapters.requests,
            self.ratio()
        )
    }
}

/// The TTFT target of goodput, ms (the 2 s).
pub(crate) const GOODPUT_TTFT_MS: f64 = 2000.0;

/// What the harness measured around the window.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Window {
    pub hit_rate: f64,
    pub router_cpu_s: Option<f64>,
}

/// Summarises a run's samples.
pub(crate) fn summarize(
    samples: &[Sample],
    window: Window,
    measure_s: f64,
    key: (&str, f64, f64, &str, u32),
) -> Row {
    let measured: Vec<&Sample> = samples.iter().filter(|s| s.measured).collect();
    let mut ttft: Vec<f64> = measured
        .iter()
        .filter_map(|s| s.ttft)
        .map(|d| d.as_secs_f64() * 1e3)
        .collect();
    ttft.sort_by(f64::total_cmp);
    let mut itl: Vec<f64> = measured
        .iter()
        .filter(|s| s.ok && s.chunks > 1)
        .map(|s| s.decode.as_secs_f64() * 1e3 / (s.chunks - 1) as f64)
        .collect();
    itl.sort_by(f64::total_cmp);
    let ok: Vec<&&Sample> = measured.iter().filter(|s| s.ok).collect();
    let first = measured
        .iter()
        .map(|s| s.finished_at.as_secs_f64() - s.latency.as_secs_f64())
        .fold(f64::INFINITY, f64::min);
    let last = ok
        .iter()
        .map(|s| s.finished_at.as_secs_f64())
        .fold(0.0, f64::max);
    let span = if last > first && first.is_finite() {
        (last - first).max(measure_s)
    } else {
        measure_s
    };
    let mut per_engine: BTreeMap<&str, usize> = BTreeMap::new();
    for s in &measured {
        if let Some(e) = &s.engine {
            *per_engine.entry(e.as_str()).or_default() += 1;
        }
    }
    let imbalance = if per_engine.is_empty() {
        f64::NAN
    } else {
        let max = per_engine.values().copied().max().unwrap_or(0) as f64;
        let mean = per_engine.values().sum::<usize>() as f64 / per_engine.len() as f64;
        max / mean
    };
    let fingerprint = {
        use std::hash::{DefaultHasher, Hash, Hasher};
        let mut h = DefaultHasher::new();
        let mut v: Vec<(usize, u64)> = samples.iter().map(|s| (s.index, s.body_hash)).collect();
        v.sort_unstable();
        v.hash(&mut h);
        format!("{:016x}", h.finish())
    };
    let good = ok
        .iter()
        .filter(|s| {
            s.ttft
                .is_some_and(|t| t.as_secs_f64() * 1e3 <= GOODPUT_TTFT_MS)
        })
        .count();
    let (workload, rate, load, policy, repeat) = key;
    Row {
        workload: workload.to_owned(),
        rate,
        load,
        policy: policy.to_owned(),
        repeat,
        requests: measured.len(),
        ok: ok.len(),
        gave_up: measured.iter().filter(|s| s.gave_up).count(),
        late: measured.iter().filter(|s| s.late.as_millis() > 10).count(),
        hit_rate: window.hit_rate,
        ttft_p50_ms: percentile(&ttft, 0.5),
        ttft_p90_ms: percentile(&ttft, 0.9),
        ttft_p99_ms: percentile(&ttft, 0.99),
        itl_p50_ms: percentile(&itl, 0.5),
        itl_p90_ms: percentile(&itl, 0.9),
        req_per_s: ok.len() as f64 / span,
        tokens_per_s: ok.iter().map(|s| s.chunks).sum::<usize>() as f64 / span,
        router_cpu_us_per_req: window
            .router_cpu_s
            .map_or(f64::NAN, |c| c * 1e6 / measured.len().max(1) as f64),
        imbalance,
        floor_p50_ms: f64::NAN,
        floor_p90_ms: f64::NAN,
        floor_p99_ms: f64::NAN,
        fingerprint,
        good,
        goodput_per_s: good as f64 / measure_s.max(1e-9),
        slow_share: f64::NAN,
        turns_kept: turns_kept(samples),
        lost: measured
            .iter()
            .filter(|s| !s.ok && !s.gave_up && s.ttft.is_none())
            .count(),
        cut: measured
            .iter()
            .filter(|s| !s.ok && !s.gave_up && s.ttft.is_some())
            .count(),
        absorb_ms: f64::NAN,
        tenants: None,
        lora: None,
        peer_bytes_per_req: f64::NAN,
        snapshot_bytes: f64::NAN,
        join_ready_ms: f64::NAN,
        join_hit_rate: f64::NAN,
        join_peers_hit_rate: f64::NAN,
        join_requests: 0,
        join_ttft_p90_ms: f64::NAN,
        join_peers_ttft_p90_ms: f64::NAN,
        join_bootstrap: String::new(),
        step_costs: Vec::new(),
    }
}

fn nan() -> f64 {
    f64::NAN
}

/// A conversation's turn from its label `c<conversation>t<turn>`.
fn conversation_turn(label: &str) -> Option<(u64, u64)> {
    let (c, t) = label.strip_prefix('c')?.split_once('t')?;
    Some((c.parse().ok()?, t.parse().ok()?))
}

/// [`Row::turns_kept`]: where the conversations' histories were left, for
/// every router that names the engine it chose.
pub(crate) fn turns_kept(samples: &[Sample]) -> f64 {
    let engines: std::collections::HashMap<(u64, u64), &str> = samples
        .iter()
        .filter_map(|s| Some((conversation_turn(&s.label)?, s.engine.as_deref()?)))
        .collect();
    let (mut kept, mut follow_ups) = (0usize, 0usize);
    for s in samples.iter().filter(|s| s.measured) {
        let Some((c, t)) = conversation_turn(&s.label) else {
            continue;
        };
        let before = t.checked_sub(1).and_then(|p| engines.get(&(c, p)));
        if let (Some(before), Some(engine)) = (before, s.engine.as_deref()) {
            follow_ups += 1;
            kept += usize::from(*before == engine);
        }
    }
    if follow_ups == 0 {
        f64::NAN
    } else {
        kept as f64 / follow_ups as f64
    }
}

/// The CSV header and one line per row.
pub(crate) fn csv(rows: &[Row]) -> String {
    let mut s = String::from(
        "workload,rate,load,policy,repeat,requests,ok,gave_up,late,hit_rate,ttft_p50_ms,ttft_p90_ms,ttft_p99_ms,itl_p50_ms,itl_p90_ms,req_per_s,tokens_per_s,router_cpu_us_per_req,imbalance,fingerprint,good,goodput_per_s,slow_share,turns_kept\n",
    );
    for r in rows {
        let _ = writeln!(
            s,
            "{},{:.3},{:.3},{},{},{},{},{},{},{:.4},{:.1},{:.1},{:.1},{:.2},{:.2},{:.3},{:.1},{:.1},{:.3},{},{},{:.3},{:.4},{:.4}",
            r.workload,
            r.rate,
            r.load,
            r.policy,
            r.repeat,
            r.requests,
            r.ok,
            r.gave_up,
            r.late,
            r.hit_rate,
            r.ttft_p50_ms,
            r.ttft_p90_ms,
            r.ttft_p99_ms,
            r.itl_p50_ms,
            r.itl_p90_ms,
            r.req_per_s,
            r.tokens_per_s,
            r.router_cpu_us_per_req,
            r.imbalance,
            r.fingerprint,
            r.good,
            r.goodput_per_s,
            r.slow_share,
            r.turns_kept
        );
    }
    s
}

/// Medians over repeats, per (workload, rate, policy), in first-seen order.
pub(crate) fn medians(rows: &[Row]) -> Vec<Row> {
    let mut groups: Vec<(String, f64, String, Vec<&Row>)> = Vec::new();
    for r in rows {
        if let Some(g) = groups
            .iter_mut()
            .find(|g| g.0 == r.workload && (g.1 - r.rate).abs() < 1e-9 && g.2 == r.policy)
        {
            g.3.push(r);
        } else {
            groups.push((r.workload.clone(), r.rate, r.policy.clone(), vec![r]));
        }
    }
    groups
        .into_iter()
        .map(|(_, _, _, rs)| {
            let m = |f: fn(&Row) -> f64| median(&rs.iter().map(|r| f(r)).collect::<Vec<_>>());
            let mu = |f: fn(&Row) -> usize| {
                median(&rs.iter().map(|r| f(r) as f64).collect::<Vec<_>>()).round() as usize
            };
            let first = rs[0];
            Row {
                workload: first.workload.clone(),
                rate: first.rate,
                load: first.load,
                policy: first.policy.clone(),
                repeat: rs.len() as u32,
                requests: mu(|r| r.requests),
                ok: mu(|r| r.ok),
                gave_up: mu(|r| r.gave_up),
                late: mu(|r| r.late),
                hit_rate: m(|r| r.hit_rate),
                ttft_p50_ms: m(|r| r.ttft_p50_ms),
                ttft_p90_ms: m(|r| r.ttft_p90_ms),
                ttft_p99_ms: m(|r| r.ttft_p99_ms),
                itl_p50_ms: m(|r| r.itl_p50_ms),
                itl_p90_ms: m(|r| r.itl_p90_ms),
                req_per_s: m(|r| r.req_per_s),
                tokens_per_s: m(|r| r.tokens_per_s),
                router_cpu_us_per_req: m(|r| r.router_cpu_us_per_req),
                imbalance: m(|r| r.imbalance),
                floor_p50_ms: first.floor_p50_ms,
                floor_p90_ms: first.floor_p90_ms,
                floor_p99_ms: first.floor_p99_ms,
                fingerprint: first.fingerprint.clone(),
                good: mu(|r| r.good),
                goodput_per_s: m(|r| r.goodput_per_s),
                slow_share: m(|r| r.slow_share),
                turns_kept: m(|r| r.turns_kept),
                lost: mu(|r| r.lost),
                cut: mu(|r| r.cut),
                absorb_ms: m(|r| r.absorb_ms),
                tenants: TenantFigures::median_of(&rs),
                lora: LoraFigures::median_of(&rs),
                peer_bytes_per_req: m(|r| r.peer_bytes_per_req),
                snapshot_bytes: m(|r| r.snapshot_bytes),
                join_ready_ms: m(|r| r.join_ready_ms),
                join_hit_rate: m(|r| r.join_hit_rate),
                join_peers_hit_rate: m(|r| r.join_peers_hit_rate),
                join_requests: mu(|r| r.join_requests),
                join_ttft_p90_ms: m(|r| r.join_ttft_p90_ms),
                join_peers_ttft_p90_ms: m(|r| r.join_peers_ttft_p90_ms),
                join_bootstrap: first.join_bootstrap.clone(),
                step_costs: first.step_costs.clone(),
            }
        })
        .collect()
}

/// Writes `results.csv`, `results.json` (with `meta`), `results.md` and the
/// plots into `dir`.
pub(crate) fn write_all(
    dir: &Path,
    meta: &serde_json::Value,
    rows: &[Row],
) -> Result<Vec<std::path::PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut files = Vec::new();
    let csv_path = dir.join("results.csv");
    std::fs::write(&csv_path, csv(rows))?;
    files.push(csv_path);
    let json_path = dir.join("results.json");
    let doc = serde_json::json!({"meta": meta, "rows": rows, "medians": medians(rows)});
    std::fs::write(&json_path, serde_json::to_string_pretty(&doc)?)?;
    files.push(json_path);
    let md_path = dir.join("results.md");
    std::fs::write(
        &md_path,
        format!(
            "{}\n{}{}{}",
            goals(rows),
            markdown(rows),
            turns_kept_table(rows),
            step_costs(rows)
        ),
    )?;
    files.push(md_path);
    let mut workloads: Vec<&str> = Vec::new();
    for r in rows {
        if !workloads.contains(&r.workload.as_str()) {
            workloads.push(&r.workload);
        }
    }
    for w in workloads {
        files.extend(plots(rows, w, dir)?);
    }
    Ok(files)
}

#[cfg(test)]
mod tests;
