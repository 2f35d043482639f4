//! Faults: what `POST /admin/faults` (and [`crate::SimHandle::inject`])
//! can do to a running engine, and the engine-wide failure state the HTTP
//! handlers read.
//!
//! Per-rank faults act on an engine core or its publisher (slow-down,
//! stall, dropped or lost batches, publisher restart, killed streams,
//! reset). Engine-wide ones act on the API server: inference requests
//! failing the way a broken engine answers ([`FailMode`]), a fraction of
//! them or all, and a slow `/metrics`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::Shared;
use crate::config::{FailMode, FaultConfig};
use crate::driver::Rank;
use crate::truth::publisher_truth;

/// The engine-wide failure state, shared by the HTTP handlers.
#[derive(Debug)]
pub(crate) struct LiveFaults {
    mode: AtomicU8,
    fraction_bits: AtomicU64,
    /// Inference requests seen while a failure mode is set.
    seen: AtomicU64,
    metrics_delay_ms: AtomicU64,
}

impl LiveFaults {
    pub(crate) fn new(cfg: &FaultConfig) -> Self {
        LiveFaults {
            mode: AtomicU8::new(mode_code(cfg.fail_requests)),
            fraction_bits: AtomicU64::new(cfg.fail_fraction.to_bits()),
            seen: AtomicU64::new(0),
            metrics_delay_ms: AtomicU64::new(cfg.metrics_delay_ms),
        }
    }

    /// The failure mode now.
    pub(crate) fn mode(&self) -> FailMode {
        match self.mode.load(Ordering::Relaxed) {
            1 => FailMode::CudaError,
            2 => FailMode::EngineDead,
            3 => FailMode::AdmissionReject,
            _ => FailMode::None,
        }
    }

    fn fraction(&self) -> f64 {
        f64::from_bits(self.fraction_bits.load(Ordering::Relaxed))
    }

    /// Whether this inference request fails, and how: request i (counted
    /// from when the mode was set) fails when `floor((i+1)·f) > floor(i·f)`,
    /// so exactly a fraction `f` of every run fails, spread evenly.
    pub(crate) fn next_request(&self) -> FailMode {
        let mode = self.mode();
        if mode == FailMode::None {
            return FailMode::None;
        }
        let f = self.fraction();
        let i = self.seen.fetch_add(1, Ordering::Relaxed) as f64;
        if ((i + 1.0) * f).floor() > (i * f).floor() {
            mode
        } else {
            FailMode::None
        }
    }

    /// The `/metrics` delay.
    pub(crate) fn metrics_delay(&self) -> Duration {
        Duration::from_millis(self.metrics_delay_ms.load(Ordering::Relaxed))
    }

    fn state(&self) -> Value {
        json!({
            "fail_requests": self.mode(),
            "fail_fraction": self.fraction(),
            "metrics_delay_ms": self.metrics_delay_ms.load(Ordering::Relaxed),
        })
    }
}

fn mode_code(m: FailMode) -> u8 {
    match m {
        FailMode::None => 0,
        FailMode::CudaError => 1,
        FailMode::EngineDead => 2,
        FailMode::AdmissionReject => 3,
    }
}

/// Faults to inject (`POST /admin/faults`, or [`crate::SimHandle::inject`]). All
/// fields are optional; `rank` limits them to one DP rank.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FaultRequest {
    /// Only this DP rank (default: all).
    pub rank: Option<u32>,
    /// Multiply step times by this (1.0 = normal).
    pub slowdown: Option<f64>,
    /// Stop stepping for this long (0 ends a stall).
    pub stall_ms: Option<u64>,
    /// Do not send the next n batches (seq used, kept for replay): a gap.
    pub drop_batches: Option<u64>,
    /// Lose the next n batches (seq used, not kept): an unrecoverable gap.
    pub lose_batches: Option<u64>,
    /// Drop every n-th batch from now on (0 = never).
    pub drop_every: Option<u64>,
    /// Restart the publisher (seq back to 0, replay ring cleared).
    pub restart_publisher: Option<bool>,
    /// How long the restarted publisher stays down, ms (default 0).
    pub restart_down_ms: Option<u64>,
    /// End every in-flight request abruptly (connections cut).
    pub kill_streams: Option<bool>,
    /// Reset the prefix cache (`AllBlocksCleared`) if idle.
    pub reset_prefix_cache: Option<bool>,
    /// How inference requests fail from now on: `none`, `cuda_error`,
    /// `engine_dead`, `admission_reject` ([`FailMode`]). Engine-wide.
    pub fail_requests: Option<FailMode>,
    /// The fraction of inference requests that fail, in (0, 1]
    /// (engine-wide; default 1).
    pub fail_fraction: Option<f64>,
    /// Delay every `/metrics` answer by this many ms (0 ends it).
    pub metrics_delay_ms: Option<u64>,
}

/// What [`crate::SimHandle::inject`] did.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FaultReport {
    /// Requests killed.
    pub killed: usize,
    /// Publishers restarted.
    pub restarted: usize,
    /// Whether the requested reset succeeded on every rank.
    pub reset: Option<bool>,
}

impl Shared {
    pub(crate) fn fault_state(&self) -> Value {
        let ranks: Vec<Value> = self
            .ranks
            .iter()
            .map(|r| {
                json!({
                    "rank": r.index,
                    "slowdown": r.slowdown(),
                    "stalled_ms": r.stalled_until().map_or(0, |u| {
                        u.saturating_duration_since(tokio::time::Instant::now()).as_millis() as u64
                    }),
                    "publisher": r.publisher.as_ref().map(|p| publisher_truth(&p.info)),
                })
            })
            .collect();
        json!({"engines": ranks, "api_server": self.faults.state()})
    }

    pub(crate) async fn apply_faults(&self, f: &FaultRequest) -> Result<FaultReport, String> {
        if let Some(r) = f.rank
            && r as usize >= self.ranks.len()
        {
            return Err(format!(
                "rank {r} does not exist (dp_size {})",
                self.ranks.len()
            ));
        }
        if let Some(s) = f.slowdown
            && !(s.is_finite() && s > 0.0)
        {
            return Err("slowdown must be a positive number".to_owned());
        }
        if let Some(x) = f.fail_fraction
            && !(x.is_finite() && x > 0.0 && x <= 1.0)
        {
            return Err("fail_fraction must be in (0, 1]".to_owned());
        }
        if let Some(m) = f.fail_requests {
            let mode = self.cfg.engine_mode;
            if m == FailMode::AdmissionReject && !mode.has_admission_control() {
                return Err(format!(
                    "{mode} has no admission control (vLLM 0.29 added it)"
                ));
            }
            if m == FailMode::EngineDead && !mode.is_vllm() {
                return Err(format!(
                    "engine_dead models vLLM's EngineDeadError, not {mode}"
                ));
            }
        }
        if let Some(x) = f.fail_fraction {
            self.faults
                .fraction_bits
                .store(x.to_bits(), Ordering::Relaxed);
        }
        if let Some(m) = f.fail_requests {
            self.faults.seen.store(0, Ordering::Relaxed);
            self.faults.mode.store(mode_code(m), Ordering::Relaxed);
        }
        if let Some(ms) = f.metrics_delay_ms {
            self.faults.metrics_delay_ms.store(ms, Ordering::Relaxed);
        }
        let targets: Vec<&Arc<Rank>> = self
            .ranks
            .iter()
            .filter(|r| f.rank.is_none_or(|o| o == r.index))
            .collect();
        let mut report = FaultReport {
            killed: 0,
            restarted: 0,
            reset: None,
        };
        for r in &targets {
            if let Some(s) = f.slowdown {
                r.set_slowdown(s);
            }
            if let Some(ms) = f.stall_ms {
                r.stall(Duration::from_millis(ms));
            }
            if let Some(p) = &r.publisher {
                if let Some(n) = f.drop_batches {
                    p.info.drop_pending.fetch_add(n, Ordering::Relaxed);
                }
                if let Some(n) = f.lose_batches {
                    p.info.lose_pending.fetch_add(n, Ordering::Relaxed);
                }
                if let Some(n) = f.drop_every {
                    p.info.drop_every.store(n, Ordering::Relaxed);
                }
            }
            if f.kill_streams == Some(true) {
                report.killed += r.kill_all();
            }
            if f.reset_prefix_cache == Some(true) {
                let ok = r.reset_prefix_cache();
                report.reset = Some(report.reset.unwrap_or(true) && ok);
            }
        }
        if f.restart_publisher == Some(true) {
            let down = Duration::from_millis(f.restart_down_ms.unwrap_or(0));
            let restarts = targets
                .iter()
                .filter_map(|r| r.publisher.clone())
                .map(|p| async move { p.restart(down).await });
            report.restarted = futures::future::join_all(restarts).await.len();
        }
        Ok(report)
    }
}
