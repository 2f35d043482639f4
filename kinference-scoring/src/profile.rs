//! Latency-model parameters and the built-in profiles' values.
//!
//! A `RoutingProfile` object (kinference-api) sets a few of these fields, each
//! optional; the router turns it into [`LatencyParams`] with
//! [`LatencyParams::with_overrides`] on top of [`LatencyParams::builtin`]`("default")`.
//! The remaining fields describe the engine's batching and the calibrator and
//! are not exposed in the CRD.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Names of the built-in profiles, as kinference-api lists them.
pub const BUILTIN_PROFILES: &[&str] = &["default"];

/// Credit for a cached block by where it is held: 1 means as good as
/// GPU-resident, 0 means it saves nothing.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TierCredits {
    /// Blocks in GPU memory.
    pub gpu: f64,
    /// Blocks offloaded to CPU memory.
    pub cpu: f64,
    /// Blocks offloaded to local disk.
    pub disk: f64,
    /// Blocks in shared or remote storage.
    #[serde(default)]
    pub storage: f64,
}

/// How the online calibrator behaves (see [`crate::calibrate`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CalibrationParams {
    /// Forgetting factor of the recursive least-squares fit per observation:
    /// the fit remembers about `1 / (1 - forgetting)` observations.
    pub forgetting: f64,
    /// Prior standard deviation of the offset, milliseconds. Also bounds how
    /// uncertain the fit may become (no covariance wind-up), so it must allow
    /// for the network and API-server overheads a deployment may add.
    pub offset_prior_sd_millis: f64,
    /// Prior standard deviation of the load scale (dimensionless).
    pub scale_prior_sd: f64,
    /// Residuals beyond this many robust standard deviations are clipped, so
    /// one outlier moves the fit by a bounded amount.
    pub clip_sigmas: f64,
    /// Initial robust spread of relative residuals (0.25 = 25 %).
    pub initial_spread: f64,
    /// Smallest robust spread of relative residuals: keeps the clip window
    /// open when predictions have been very accurate.
    pub min_spread: f64,
    /// Weight of each observation in the robust spread estimate.
    pub spread_weight: f64,
    /// Lowest and highest load scale the fit may reach.
    pub scale_bounds: (f64, f64),
    /// Highest offset the fit may reach, in milliseconds above `base_millis`.
    pub max_extra_offset_millis: f64,
    /// A fit is fresh for this long after its last observation.
    pub stale_after: Duration,
    /// After `stale_after`, the fit decays back to the prior, half-way after
    /// this long (hyperbolically), so an endpoint that looked slow is tried
    /// again.
    pub stale_half_life: Duration,
}

/// Parameters of the time-to-first-token model, for one worker set.
///
/// Predicted TTFT (see [`crate::latency`]) = `base` + (prefill work ahead of
/// the request + its own uncached tokens) ÷ throughput + the number of engine
/// steps that work takes × (per-step overhead + decode cost × decoding
/// sequences) + a KV-pressure term; then calibrated per endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LatencyParams {
    /// Prefill throughput of one engine, prompt tokens per second (CRD
    /// `prefillTokensPerSecond`).
    pub prefill_tokens_per_second: f64,
    /// Fixed cost of every request before its first token that is not engine
    /// step time: HTTP, tokenisation, scheduling, detokenisation (CRD
    /// `baseMillis`).
    pub base_millis: f64,
    /// Time each decoding sequence adds to every engine step (CRD
    /// `decodeCostMillis`). A prompt that fits one step is delayed by exactly
    /// this much per running request, as the CRD documents.
    pub decode_cost_millis: f64,
    /// Credit for cached blocks by tier (CRD `tierCredits`).
    pub tier_credits: TierCredits,
    /// How much later a warmer endpoint's predicted first token may be than a
    /// colder one's before the colder one wins (CRD `toleranceMillis`).
    pub tolerance_millis: f64,
    /// Correct the model online per endpoint (CRD `calibrate`).
    pub calibrate: bool,
    /// Fixed time of one engine step (weights read once per step).
    pub step_overhead_millis: f64,
    /// Tokens one engine step may process (vLLM `max_num_batched_tokens`);
    /// each decoding sequence uses one, prefill chunks use the rest.
    pub step_token_budget: u32,
    /// Scraped engine figures older than this are ignored; younger ones are
    /// trusted linearly less with age.
    pub metrics_max_age: Duration,
    /// Prompt tokens assumed for a request an engine reports waiting that this
    /// router did not send (another router replica or client).
    pub unseen_request_tokens: u32,
    /// KV-cache usage (0..1) above which the engine is considered short of
    /// blocks.
    pub kv_pressure_start: f64,
    /// Delay added at 100 % KV-cache usage, growing linearly from
    /// `kv_pressure_start` (the usage counting the blocks the request and
    /// the prefill queued before it will take, where the cache's size is
    /// known; up to twice this past full). Where the size is known, the
    /// kinference policy uses the time its streams take to decode instead,
    /// once it has seen a few: about how long running sequences take to
    /// free their blocks.
    pub kv_full_penalty_millis: f64,
    /// Credit multiplier for cache estimates from the router's own prefix
    /// record (approximate mode): the engine may have evicted them.
    pub approximate_credit: f64,
    /// Candidates whose scores differ by less than
    /// `max(tie_millis, tie_fraction × best)` are equals; equals are spread by
    /// least-recently-chosen.
    pub tie_millis: f64,
    /// See `tie_millis`.
    pub tie_fraction: f64,
    /// Cap on the externality multiplier of [`crate::Kinference`]'s score: a
    /// choice is charged its prefill time s × min(the requests that will
    /// arrive behind it before it is done, this cap), the delay its work
    /// imposes on them (at arrival rate λ behind a queue of W: λ·(W + s÷2)).
    /// 0 turns the charge
    /// off: pure TTFT greed, which under load replicates prefixes until the
    /// caches thrash (see `examples/fleet.rs`).
    pub externality_cap: f64,
    /// Evidence from requests still waiting (see [`crate::Evidence`]): a
    /// request older than its prediction by more than this slack shows the
    /// endpoint slower than its calibration; the load part is scaled by
    /// `(age − slack) ÷ predicted`. The slack keeps scheduling noise on a
    /// healthy engine from counting.
    pub overdue_slack_millis: f64,
    /// The largest factor that evidence may scale the load part by (the
    /// calibration's own bound, `scale_bounds`, is smaller: it is a fit,
    /// this is a lower bound that holds only while the request waits).
    pub overdue_max_scale: f64,
    /// Evidence from the engine's KV events ([`crate::Evidence::
    /// stored_steps`]): while a request with prefill work waits there, an
    /// engine on time stores blocks every step. A silence of `n + 1` full
    /// steps' predicted time beyond this grace (event delivery, scheduling)
    /// with only `n` storing steps seen shows its steps at least
    /// `(age − grace) ÷ ((n + 1) × step)` times slower than predicted (the
    /// step: the prefill work waiting there, up to the step budget).
    #[serde(default = "default_stall_grace_millis")]
    pub stall_grace_millis: f64,
    /// That ratio counts only from this factor on (below it, a healthy
    /// engine's jitter and steps without a whole block could show); then
    /// it scales the load part, up to `overdue_max_scale`.
    #[serde(default = "default_stall_min_scale")]
    pub stall_min_scale: f64,
    /// With not one storing step since the oldest request was sent to an
    /// endpoint where this router had nothing else in flight, its lower
    /// bound `(age − grace) ÷ predicted`, once past 1, is multiplied by
    /// this factor: the engine's first step has outlived the whole
    /// prediction, and a duration that has outlived its expectation is
    /// expected, on a heavy tail, to last about as long again (the
    /// default, 2: Pareto's with index 2; 1 is the lower bound alone). The
    /// kinference policy applies it only while the fleet's first tokens
    /// say the profile predicts its engines' speed (within 2×): on a
    /// mispredicting profile every idle engine looks late at first.
    #[serde(default = "default_silent_overdue_factor")]
    pub silent_overdue_factor: f64,
    /// Added to the prediction of an endpoint that refused a request with
    /// 503 (admission control) just now, fading linearly to 0 over
    /// `metrics_max_age`.
    pub refusal_penalty_millis: f64,
    /// Added when a LoRA adapter request goes where its adapter must first
    /// be loaded into a free slot ([`crate::AdapterSlot::Free`]).
    #[serde(default = "default_adapter_load_millis")]
    pub adapter_load_millis: f64,
    /// Added when every adapter slot there holds another adapter with
    /// running requests ([`crate::AdapterSlot::Full`]): the request waits
    /// until one of them drains.
    #[serde(default = "default_adapter_slot_wait_millis")]
    pub adapter_slot_wait_millis: f64,
    /// [`crate::Kinference`] charges a choice `eviction_weight` × the
    /// prefill time of the cached blocks its own prefill would evict there
    /// ([`crate::KvRoom`]): later requests may recompute them. 0 turns the
    /// charge off.
    #[serde(default = "default_eviction_weight")]
    pub eviction_weight: f64,
    /// With `calibrate`, learn the engines' step costs (overhead, decode
    /// cost, prefill speed) from the gaps between streamed tokens and
    /// predict with them ([`crate::steps`]; CRD `learnStepCosts`). Turn it
    /// off where a stream's chunks are not one token a step (vLLM's
    /// `--stream-interval` above 1, speculative decoding) and the response
    /// has no `usage`.
    #[serde(default = "yes")]
    pub learn_step_costs: bool,
    /// The online calibrator.
    pub calibration: CalibrationParams,
}

fn yes() -> bool {
    true
}

/// The reference engine of the built-in `default` profile: vLLM (V1 engine,
/// OpenAI server) serving a dense 8B-class model (e.g. Llama-3.1-8B, bf16) on
/// one H100 SXM 80 GB. Calibration corrects the rest online.
const DEFAULT: LatencyParams = LatencyParams {
    // Compute-bound estimate: 2 × 8.0e9 FLOPs per prompt token = 16 GFLOP;
    // H100 SXM dense bf16 peak 989 TFLOPS (NVIDIA H100 datasheet) at ~40 %
    // effective utilisation including attention at a few thousand tokens of
    // context = ~25k tokens/s. Cross-check: llm-d measured 15,928 tokens/s
    // for Qwen 32B on 2 × H100 TP=2 with vLLM 0.19 (llm-d-router
    // prefixcacheaffinity README), i.e. ~51 % utilisation of the same
    // arithmetic.
    prefill_tokens_per_second: 25_000.0,
    // Estimate of the non-step part of TTFT in vLLM's OpenAI server: request
    // parsing and tokenisation in the API process, IPC to the engine core,
    // scheduling, detokenisation and the first SSE write, a few ms together.
    base_millis: 5.0,
    // KV bytes read per decoding sequence per step: Llama-3.1-8B holds
    // 2 (K,V) × 32 layers × 8 KV heads × 128 dims × 2 bytes = 128 KiB per
    // token; at ~2k tokens of context that is 256 MiB, 0.08 ms at H100's
    // 3.35 TB/s HBM3 (datasheet), plus sampling: ~0.1 ms.
    decode_cost_millis: 0.1,
    tier_credits: TierCredits {
        // Resident blocks cost nothing to reuse.
        gpu: 1.0,
        // Loading 128 KiB per token over PCIe Gen5 x16 (64 GB/s peak, ~40 GB/s
        // achieved) costs ~3 µs per token against ~40 µs to recompute it at
        // 25k tokens/s; offloading connectors add overhead, so 0.8 rather
        // than 0.9.
        cpu: 0.8,
        // NVMe Gen4 at ~7 GB/s: ~19 µs per token, about half the recompute
        // cost; 0.4 leaves room for filesystem and connector overhead.
        disk: 0.4,
        // Shared file systems and object stores over the network (a few
        // hundred MB/s to a few GB/s per engine): a fraction of recompute.
        storage: 0.2,
    },
    // About the GPU time of recomputing a 1–2k-token shared prefix at 25k
    // tokens/s (40–80 ms): going cold pays that again and spends KV memory on
    // a second copy, so a warm endpoint keeps the request unless it is later
    // by more than that.
    tolerance_millis: 50.0,
    calibrate: true,
    // Memory-bound floor of a step: 16 GB of bf16 weights read at 3.35 TB/s
    // = 4.8 ms, plus kernel launch and scheduler overhead with CUDA graphs.
    step_overhead_millis: 6.0,
    // vLLM's default `max_num_batched_tokens` for the OpenAI server on GPUs
    // with ≥ 70 GiB other than A100 (vllm/engine/arg_utils.py,
    // EngineArgs.get_batch_defaults).
    step_token_budget: 8192,
    // Typical scrape intervals are 50 ms–1 s; two seconds covers a missed
    // scrape.
    metrics_max_age: Duration::from_secs(2),
    // Assumption: a typical chat prompt. Used only when an engine reports more
    // waiting requests than this router has in flight there.
    unseen_request_tokens: 1024,
    // vLLM's scheduler preempts or stops admitting once free blocks run out;
    // 90 % usage leaves few blocks for a long prompt. Heuristic.
    kv_pressure_start: 0.9,
    // Heuristic: roughly ten decode steps, the wait for running sequences to
    // finish and free blocks.
    kv_full_penalty_millis: 100.0,
    // Heuristic: a prefix this router sent within the record's TTL is usually
    // still resident.
    approximate_credit: 0.9,
    tie_millis: 2.0,
    tie_fraction: 0.03,
    // Measured on examples/fleet.rs (8 engines, 200 prefix groups): with 8
    // the median TTFT at 250 req/s was 4× worse than with 32, and 32 and
    // uncapped behaved alike; the cap bounds stickiness under overload.
    externality_cap: 32.0,
    // Heuristic: a few steps of scheduling jitter and one missed decode
    // round; below this an engine is on time.
    overdue_slack_millis: 100.0,
    // Ten times the calibration's bound: a stuck engine's lower bound keeps
    // growing until its first token, so the cap only bounds arithmetic.
    overdue_max_scale: 40.0,
    // Event delivery (the engine's publisher thread, ZeroMQ, the router's
    // subscription task) takes a few milliseconds; 20 covers a busy
    // router's task switches too.
    stall_grace_millis: 20.0,
    // Heuristic: three steps without a stored block while prefill work
    // waits; a healthy engine's step varies by tens of percent, and a step
    // whose prefill chunk ends inside a block stores nothing for that
    // request (but the next one does).
    stall_min_scale: 3.0,
    // The expected total of a duration that has outlived its expectation
    // under a Pareto tail of index 2: it kept a 10x slower engine out of a
    // burst sooner on a tuned profile. The kinference policy applies it
    // only while the profile fits the fleet: with the built-in profile on
    // engines it mispredicts, every idle engine looks late until
    // calibration catches up, and doubling that moved requests off their
    // cached engine (multi-turn's hit rate fell about 5 points;
    // docs/benchmarks.md, 2026-12-05 and 2026-12-06).
    silent_overdue_factor: 2.0,
    // An engine at its admission limit refuses again until its queue
    // drains: about one long prefill, so that any engine with room wins.
    refusal_penalty_millis: 1_000.0,
    // vLLM loads an adapter from its CPU cache (`--max-cpu-loras`) into a
    // GPU slot in a few milliseconds, from local disk in tens: 25 ms, the
    // simulator's default too.
    adapter_load_millis: 25.0,
    // A slot frees when every running request of some adapter has
    // finished: a few hundred decode steps at ~10 ms. Heuristic, sized so
    // that any engine with a free slot wins unless it is seconds busier.
    adapter_slot_wait_millis: 2_000.0,
    // One recompute per evicted block: the cache's LRU victims are the
    // least likely to be asked for again, but on an over-full engine they
    // are what its next requests need. Measured on the benchmark's
    // heterogeneous workload (docs/benchmarks.md).
    eviction_weight: 1.0,
    learn_step_costs: true,
    calibration: CalibrationParams {
        forgetting: 0.98,
        offset_prior_sd_millis: 50.0,
        scale_prior_sd: 0.5,
        clip_sigmas: 3.0,
        initial_spread: 0.25,
        min_spread: 0.03,
        spread_weight: 0.05,
        scale_bounds: (0.25, 4.0),
        max_extra_offset_millis: 2_000.0,
        stale_after: Duration::from_secs(30),
        stale_half_life: Duration::from_secs(120),
    },
};

fn default_adapter_load_millis() -> f64 {
    DEFAULT.adapter_load_millis
}

fn default_adapter_slot_wait_millis() -> f64 {
    DEFAULT.adapter_slot_wait_millis
}

fn default_stall_grace_millis() -> f64 {
    DEFAULT.stall_grace_millis
}

fn default_stall_min_scale() -> f64 {
    DEFAULT.stall_min_scale
}

fn default_silent_overdue_factor() -> f64 {
    DEFAULT.silent_overdue_factor
}

fn default_eviction_weight() -> f64 {
    DEFAULT.eviction_weight
}

impl Default for LatencyParams {
    /// The built-in `default` profile.
    fn default() -> Self {
        DEFAULT
    }
}

/// Optional overrides, field for field the CRD's `spec.latency`. Unset fields
/// keep the base profile's value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Overrides {
    /// `prefillTokensPerSecond`.
    pub prefill_tokens_per_second: Option<f64>,
    /// `baseMillis`.
    pub base_millis: Option<f64>,
    /// `decodeCostMillis`.
    pub decode_cost_millis: Option<f64>,
    /// `tierCredits.gpu`.
    pub gpu_credit: Option<f64>,
    /// `tierCredits.cpu`.
    pub cpu_credit: Option<f64>,
    /// `tierCredits.disk`.
    pub disk_credit: Option<f64>,
    /// `tierCredits.storage`.
    pub storage_credit: Option<f64>,
    /// `toleranceMillis`.
    pub tolerance_millis: Option<f64>,
    /// `calibrate`.
    pub calibrate: Option<bool>,
    /// `learnStepCosts`.
    pub learn_step_costs: Option<bool>,
}

/// A parameter outside its valid range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field} must be {expected}, got {value}")]
pub struct ParamsError {
    /// The field, as the CRD spells it where it has a CRD name.
    pub field: &'static str,
    /// What a valid value looks like.
    pub expected: &'static str,
    /// The rejected value.
    pub value: f64,
}

impl LatencyParams {
    /// A built-in profile by name (see [`BUILTIN_PROFILES`]).
    pub fn builtin(name: &str) -> Option<Self> {
        match name {
            "default" => Some(DEFAULT),
            _ => None,
        }
    }

    /// These parameters with `overrides` applied, validated.
    ///
    /// # Errors
    ///
    /// [`ParamsError`] naming the first field out of range (the same ranges
    /// the CRD's CEL rules enforce, plus finiteness).
    pub fn with_overrides(mut self, overrides: &Overrides) -> Result<Self, ParamsError> {
        let o = overrides;
        if let Some(v) = o.prefill_tokens_per_second {
            self.prefill_tokens_per_second = v;
        }
        if let Some(v) = o.base_millis {
            self.base_millis = v;
        }
        if let Some(v) = o.decode_cost_millis {
            self.decode_cost_millis = v;
        }
        if let Some(v) = o.gpu_credit {
            self.tier_credits.gpu = v;
        }
        if let Some(v) = o.cpu_credit {
            self.tier_credits.cpu = v;
        }
        if let Some(v) = o.disk_credit {
            self.tier_credits.disk = v;
        }
        if let Some(v) = o.storage_credit {
            self.tier_credits.storage = v;
        }
        if let Some(v) = o.tolerance_millis {
            self.tolerance_millis = v;
        }
        if let Some(v) = o.calibrate {
            self.calibrate = v;
        }
        if let Some(v) = o.learn_step_costs {
            self.learn_step_costs = v;
        }
        self.validate()?;
        Ok(self)
    }

    /// Check every field's range.
    ///
    /// # Errors
    ///
    /// [`ParamsError`] naming the first field out of range.
    pub fn validate(&self) -> Result<(), ParamsError> {
        fn positive(field: &'static str, value: f64) -> Result<(), ParamsError> {
            if value.is_finite() && value > 0.0 {
                Ok(())
            } else {
                Err(ParamsError {
                    field,
                    expected: "finite and greater than 0",
                    value,
                })
            }
        }
        fn non_negative(field: &'static str, value: f64) -> Result<(), ParamsError> {
            if value.is_finite() && value >= 0.0 {
                Ok(())
            } else {
                Err(ParamsError {
                    field,
                    expected: "finite and not negative",
                    value,
                })
            }
        }
        fn at_least_one(field: &'static str, value: f64) -> Result<(), ParamsError> {
            if value.is_finite() && value >= 1.0 {
                Ok(())
            } else {
                Err(ParamsError {
                    field,
                    expected: "finite and at least 1",
                    value,
                })
            }
        }
        fn unit(field: &'static str, value: f64) -> Result<(), ParamsError> {
            if (0.0..=1.0).contains(&value) {
                Ok(())
            } else {
                Err(ParamsError {
                    field,
                    expected: "between 0 and 1",
                    value,
                })
            }
        }
        positive("prefillTokensPerSecond", self.prefill_tokens_per_second)?;
        non_negative("baseMillis", self.base_millis)?;
        non_negative("decodeCostMillis", self.decode_cost_millis)?;
        unit("tierCredits.gpu", self.tier_credits.gpu)?;
        unit("tierCredits.cpu", self.tier_credits.cpu)?;
        unit("tierCredits.disk", self.tier_credits.disk)?;
        unit("tierCredits.storage", self.tier_credits.storage)?;
        non_negative("toleranceMillis", self.tolerance_millis)?;
        non_negative("stepOverheadMillis", self.step_overhead_millis)?;
        positive("stepTokenBudget", f64::from(self.step_token_budget))?;
        unit("kvPressureStart", self.kv_pressure_start)?;
        non_negative("kvFullPenaltyMillis", self.kv_full_penalty_millis)?;
        unit("approximateCredit", self.approximate_credit)?;
        non_negative("tieMillis", self.tie_millis)?;
        non_negative("tieFraction", self.tie_fraction)?;
        non_negative("externalityCap", self.externality_cap)?;
        non_negative("overdueSlackMillis", self.overdue_slack_millis)?;
        at_least_one("overdueMaxScale", self.overdue_max_scale)?;
        non_negative("stallGraceMillis", self.stall_grace_millis)?;
        at_least_one("stallMinScale", self.stall_min_scale)?;
        at_least_one("silentOverdueFactor", self.silent_overdue_factor)?;
        non_negative("refusalPenaltyMillis", self.refusal_penalty_millis)?;
        non_negative("adapterLoadMillis", self.adapter_load_millis)?;
        non_negative("adapterSlotWaitMillis", self.adapter_slot_wait_millis)?;
        non_negative("evictionWeight", self.eviction_weight)?;
        let c = &self.calibration;
        if !(c.forgetting > 0.0 && c.forgetting <= 1.0) {
            return Err(ParamsError {
                field: "calibration.forgetting",
                expected: "in (0, 1]",
                value: c.forgetting,
            });
        }
        positive("calibration.offsetPriorSdMillis", c.offset_prior_sd_millis)?;
        positive("calibration.scalePriorSd", c.scale_prior_sd)?;
        positive("calibration.clipSigmas", c.clip_sigmas)?;
        positive("calibration.initialSpread", c.initial_spread)?;
        positive("calibration.minSpread", c.min_spread)?;
        unit("calibration.spreadWeight", c.spread_weight)?;
        positive("calibration.scaleBounds.min", c.scale_bounds.0)?;
        if !(c.scale_bounds.1.is_finite() && c.scale_bounds.1 >= c.scale_bounds.0) {
            return Err(ParamsError {
                field: "calibration.scaleBounds.max",
                expected: "finite and at least scaleBounds.min",
                value: c.scale_bounds.1,
            });
        }
        non_negative(
            "calibration.maxExtraOffsetMillis",
            c.max_extra_offset_millis,
        )?;
        positive("calibration.staleHalfLife", c.stale_half_life.as_secs_f64())?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_builtin_exists_and_is_valid() {
        for name in BUILTIN_PROFILES {
            let p = LatencyParams::builtin(name).expect("listed profile exists");
            p.validate().expect("built-in profile is valid");
        }
        assert_eq!(LatencyParams::builtin("nope"), None);
        assert_eq!(
            LatencyParams::default(),
            LatencyParams::builtin("default").unwrap()
        );
    }

    #[test]
    fn unset_overrides_keep_the_default() {
        let p = LatencyParams::default()
            .with_overrides(&Overrides::default())
            .unwrap();
        assert_eq!(p, LatencyParams::default());
    }

    #[test]
    fn overrides_replace_only_their_fields() {
        let o = Overrides {
            prefill_tokens_per_second: Some(10_000.0),
            cpu_credit: Some(0.5),
            calibrate: Some(false),
            ..Overrides::default()
        };
        let p = LatencyParams::default().with_overrides(&o).unwrap();
        assert!((p.prefill_tokens_per_second - 10_000.0).abs() < f64::EPSILON);
        assert!((p.tier_credits.cpu - 0.5).abs() < f64::EPSILON);
        assert!(!p.calibrate);
        assert!((p.tier_credits.gpu - DEFAULT.tier_credits.gpu).abs() < f64::EPSILON);
        assert!((p.base_millis - DEFAULT.base_millis).abs() < f64::EPSILON);
    }

    #[test]
    fn out_of_range_overrides_name_the_field() {
        let cases = [
            (
                Overrides {
                    prefill_tokens_per_second: Some(0.0),
                    ..Overrides::default()
                },
                "prefillTokensPerSecond",
            ),
            (
                Overrides {
                    prefill_tokens_per_second: Some(f64::NAN),
                    ..Overrides::default()
                },
                "prefillTokensPerSecond",
            ),
            (
                Overrides {
                    base_millis: Some(-1.0),
                    ..Overrides::default()
                },
                "baseMillis",
            ),
            (
                Overrides {
                    decode_cost_millis: Some(f64::INFINITY),
                    ..Overrides::default()
                },
                "decodeCostMillis",
            ),
            (
                Overrides {
                    disk_credit: Some(1.5),
                    ..Overrides::default()
                },
                "tierCredits.disk",
            ),
            (
                Overrides {
                    tolerance_millis: Some(-0.1),
                    ..Overrides::default()
                },
                "toleranceMillis",
            ),
        ];
        for (o, field) in cases {
            let err = LatencyParams::default().with_overrides(&o).unwrap_err();
            assert_eq!(err.field, field);
            assert!(err.to_string().starts_with(field), "{err}");
        }
    }
}
