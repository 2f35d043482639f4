//! The scaled fleet of simulated engines a run starts, and the tuned
//! router's objects for it.

use std::path::Path;

use super::{
    BLOCK_SIZE, DECODE_MS_PER_SEQ, EngineSpec, KV_TOKENS_PER_ENGINE, MAX_MODEL_LEN, Manifests,
    PREFILL_MS_PER_TOKEN, SLOW_BURST_SLOWDOWN, STEP_BASE_MS, STEP_TOKEN_BUDGET, Scale, Sim,
    StepModel, Workload, WorkloadKind,
};

/// The scaled fleet.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub(crate) struct Fleet {
    pub engines: usize,
    /// The slow-burst fleet's last engine's slowdown.
    pub burst_slowdown: f64,
    pub scale: Scale,
    pub population: u32,
    pub step: StepModel,
    pub num_gpu_blocks: u32,
}

impl Fleet {
    pub(crate) fn new(engines: usize, k: u32, population: u32) -> Self {
        let scale = Scale { k: k.max(1) };
        let population = population.max(1);
        let kf = f64::from(scale.k);
        Self {
            engines,
            burst_slowdown: SLOW_BURST_SLOWDOWN,
            scale,
            population,
            step: StepModel {
                base_ms: STEP_BASE_MS,
                prefill_ms_per_token: PREFILL_MS_PER_TOKEN * kf,
                decode_ms_per_seq: DECODE_MS_PER_SEQ * kf,
                budget: scale.tokens(STEP_TOKEN_BUDGET),
                block_size: BLOCK_SIZE,
            },
            // + vLLM's null block.
            num_gpu_blocks: scale
                .tokens(KV_TOKENS_PER_ENGINE / population)
                .div_ceil(BLOCK_SIZE)
                + 1,
        }
    }

    /// One engine's prefill throughput with full steps, in real tokens/s.
    pub(crate) fn prefill_tokens_per_s(&self) -> f64 {
        let budget = f64::from(self.step.budget);
        let step_ms = self.step.base_ms + budget * self.step.prefill_ms_per_token;
        budget * f64::from(self.scale.k) / step_ms * 1e3
    }

    /// KV tokens per engine, real.
    pub(crate) fn kv_tokens_per_engine(&self) -> f64 {
        f64::from(KV_TOKENS_PER_ENGINE / self.population)
    }

    /// The workload for this fleet's population scale.
    pub(crate) fn workload(&self, kind: WorkloadKind) -> Workload {
        Workload::of(kind).with_population(self.population)
    }

    /// Each engine's slowdown for `kind` on this fleet.
    pub(crate) fn slowdowns(&self, kind: WorkloadKind) -> Vec<f64> {
        kind.slowdowns(self.engines, self.burst_slowdown)
    }

    /// Engines' worth of prefill throughput for `kind`'s fleet: Σ 1 ÷
    /// slowdown.
    pub(crate) fn capacity(&self, kind: WorkloadKind) -> f64 {
        self.slowdowns(kind).iter().map(|s| 1.0 / s).sum()
    }

    /// The rate at which the fleet's prefill saturates when nothing is
    /// reused: capacity × prefill throughput ÷ prompt tokens.
    pub(crate) fn knee(&self, kind: WorkloadKind, w: &Workload) -> f64 {
        self.capacity(kind) * self.prefill_tokens_per_s() / w.mean_prompt_tokens()
    }

    /// The same with perfect reuse (only new text computed).
    pub(crate) fn knee_with_reuse(&self, kind: WorkloadKind, w: &Workload) -> f64 {
        self.capacity(kind) * self.prefill_tokens_per_s() / w.mean_new_tokens()
    }

    /// The simulator processes for `kind`: one per engine speed, engine i
    /// on HTTP `base + i`, KV `base + 100 + i`, replay `base + 200 + i`,
    /// with the workload's own flags (LoRA adapters) last.
    pub(super) fn sims(&self, kind: WorkloadKind, port_base: u16) -> Vec<Sim> {
        let s = self.step;
        let speeds = self.slowdowns(kind);
        let mut out = Vec::new();
        let mut i = 0;
        while i < speeds.len() {
            let n = speeds[i..]
                .iter()
                .take_while(|x| (**x - speeds[i]).abs() < 1e-12)
                .count();
            let sim = Sim::new(n, http_port(port_base, i), kv_port(port_base, i))
                .with_replay(kv_port(port_base, i) + 100)
                .with_args([
                    "--num-gpu-blocks".to_owned(),
                    self.num_gpu_blocks.to_string(),
                    "--max-model-len".into(),
                    self.scale.tokens(MAX_MODEL_LEN).to_string(),
                    "--block-size".into(),
                    s.block_size.to_string(),
                    "--max-num-batched-tokens".into(),
                    s.budget.to_string(),
                    "--step-base-ms".into(),
                    s.base_ms.to_string(),
                    "--prefill-ms-per-token".into(),
                    s.prefill_ms_per_token.to_string(),
                    "--decode-ms-per-seq".into(),
                    s.decode_ms_per_seq.to_string(),
                    "--slowdown".into(),
                    speeds[i].to_string(),
                    "--seed".into(),
                    "1".into(),
                ])
                .with_args(kind.engine_args());
            out.push(sim);
            i += n;
        }
        out
    }

    /// The tuned router's objects: pool `bench`, worker set `sim`, a
    /// profile with the scaled simulator's latency and `local`
    /// tokenization, one EndpointSlice per engine.
    pub(super) fn manifests(&self, root: &Path, port_base: u16) -> Manifests {
        let tokenizer = root.join("examples").join("word-level");
        let s = self.step;
        let engines = (0..self.engines)
            .map(|i| EngineSpec {
                http: http_port(port_base, i),
                kv: Some(kv_port(port_base, i)),
            })
            .collect();
        let mut m = Manifests::new("bench", engines);
        m.block_size = s.block_size;
        m.profile = Some((
            "bench".into(),
            format!(
                "  tokenization:\n    mode: local\n    tokenizer: {{path: {}}}\n  latency:\n    prefillTokensPerSecond: {:.1}\n    decodeCostMillis: {}\n    calibrate: true\n",
                tokenizer.display(),
                1e3 / s.prefill_ms_per_token,
                s.decode_ms_per_seq,
            ),
        ));
        m
    }
}

/// Adds `field: value` lines to the tuned profile's `latency:` block (the
/// last block of its spec).
pub(super) fn add_latency_fields(m: &mut Manifests, fields: &[(String, String)]) {
    use std::fmt::Write as _;
    if let Some((_, spec)) = &mut m.profile {
        for (k, v) in fields {
            let _ = writeln!(spec, "    {k}: {v}");
        }
    }
}

pub(super) fn http_port(base: u16, i: usize) -> u16 {
    base + i as u16
}
pub(super) fn kv_port(base: u16, i: usize) -> u16 {
    base + 100 + i as u16
}
pub(super) fn listen_addr(base: u16) -> String {
    format!("127.0.0.1:{}", base + 300)
}
pub(super) fn admin_addr(base: u16) -> String {
    format!("127.0.0.1:{}", base + 301)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scaled_fleet_keeps_prefill_time_and_llm_d_s_kv_ratio() {
        let f = Fleet::new(8, 10, 1);
        assert_eq!(f.step.budget, 204);
        assert!((f.step.prefill_ms_per_token - 0.86).abs() < 1e-12);
        assert!((f.step.decode_ms_per_seq - 0.65).abs() < 1e-12);
        // 30,732 scaled tokens = 1,921 blocks, + the null block.
        assert_eq!(f.num_gpu_blocks, 1922);
        // Same real prefill throughput scaled and unscaled (within the
        // budget's rounding).
        let unscaled = Fleet::new(8, 1, 1).prefill_tokens_per_s();
        assert!((f.prefill_tokens_per_s() / unscaled - 1.0).abs() < 0.01);
        // Knee of the shared-prefix workload: 8 × ~11.3k ÷ 7,200 ≈ 12.6/s.
        let sp = WorkloadKind::SharedPrefix;
        let knee = f.knee(sp, &Workload::of(sp));
        // Two of eight engines 3× slower: 6 + 2/3 engines' worth.
        let het = WorkloadKind::Heterogeneous;
        assert!((f.knee(het, &Workload::of(het)) / knee - (6.0 + 2.0 / 3.0) / 8.0).abs() < 1e-9);
        assert!((knee - 12.56).abs() < 0.1, "{knee}");
        // A fifth of the groups and of the KV: 6,146 tokens in 385 blocks,
        // + the null block.
        let small = Fleet::new(8, 10, 5);
        assert_eq!(small.num_gpu_blocks, 386);
        assert!((small.knee(sp, &small.workload(sp)) - knee).abs() < 1e-9);
    }

    /// The whole harness for a few seconds: two debug-built engines, ours
    /// and the oracle, then the output files parsed back.

    #[test]
    fn the_slow_burst_fleet_is_as_slow_as_asked_and_other_fleets_are_not_touched() {
        let mut f = Fleet::new(4, 10, 5);
        assert_eq!(f.slowdowns(WorkloadKind::SlowBurst), [1.0, 1.0, 1.0, 10.0]);
        f.burst_slowdown = 1.0;
        assert_eq!(f.slowdowns(WorkloadKind::SlowBurst), [1.0; 4]);
        assert!((f.capacity(WorkloadKind::SlowBurst) - 4.0).abs() < 1e-12);
        assert_eq!(
            f.slowdowns(WorkloadKind::Heterogeneous),
            WorkloadKind::Heterogeneous.slowdowns(4, 1.0)
        );
    }

    #[test]
    fn extra_latency_fields_land_in_the_latency_block() {
        let f = Fleet::new(2, 10, 5);
        let mut m = f.manifests(Path::new("/repo"), 19000);
        add_latency_fields(&mut m, &[("toleranceMillis".into(), "150".into())]);
        let y = m.yaml();
        let latency = y.split("  latency:\n").nth(1).expect("a latency block");
        let block: Vec<&str> = latency
            .lines()
            .take_while(|l| l.starts_with("    "))
            .collect();
        assert!(block.contains(&"    toleranceMillis: 150"), "{y}");
        assert!(block.contains(&"    calibrate: true"), "{y}");
    }

    #[test]
    fn manifests_list_every_engine_and_the_scaled_profile() {
        let f = Fleet::new(3, 10, 5);
        let y = f.manifests(Path::new("/repo"), 19000).yaml();
        assert_eq!(y.matches("kind: EndpointSlice").count(), 3);
        assert!(y.contains("port: 19002}, {name: kv, port: 19102}"));
        assert!(y.contains("prefillTokensPerSecond: 1162.8"));
        assert!(y.contains("path: /repo/examples/word-level"));
    }

    #[test]
    fn only_the_lora_fleet_serves_adapters_in_two_slots() {
        let f = Fleet::new(4, 10, 5);
        for kind in WorkloadKind::ALL {
            for sim in f.sims(kind, 18500) {
                let args = sim.args();
                let flag = |name: &str| {
                    args.iter()
                        .position(|a| a == name)
                        .map(|i| args[i + 1].as_str())
                };
                if kind == WorkloadKind::Lora {
                    assert_eq!(
                        flag("--lora-modules"),
                        Some("lora-1,lora-2,lora-3,lora-4,lora-5,lora-6,lora-7,lora-8")
                    );
                    assert_eq!(flag("--max-loras"), Some("2"));
                    // The default adapter load time.
                    assert_eq!(flag("--lora-load-ms"), None);
                    // The fleet's own flags are still there.
                    assert_eq!(flag("--slowdown"), Some("1"));
                } else {
                    assert!(
                        !args.iter().any(|a| a.contains("lora")),
                        "{kind:?}: {args:?}"
                    );
                }
            }
        }
        // The shared-prefix fleet's knee and the same prompts.
        let (lora, sp) = (WorkloadKind::Lora, WorkloadKind::SharedPrefix);
        assert!((f.knee(lora, &f.workload(lora)) - f.knee(sp, &f.workload(sp))).abs() < 1e-9);
        assert!(
            (f.workload(lora).resident_tokens() - f.workload(sp).resident_tokens()).abs() < 1e-6
        );
    }

    #[test]
    fn two_speed_fleets_run_one_simulator_per_speed() {
        let f = Fleet::new(8, 10, 5);
        let sims = f.sims(WorkloadKind::Agent, 18500);
        assert_eq!(sims.len(), 2);
        assert_eq!((sims[0].engines, sims[1].engines), (6, 2));
        let slow = sims[1].args().join(" ");
        assert!(
            slow.contains("--port 18506 --kv-port 18606 --replay-port 18706"),
            "{slow}"
        );
        assert!(slow.contains("--slowdown 3"), "{slow}");
        assert_eq!(f.sims(WorkloadKind::SharedPrefix, 18500).len(), 1);
    }
}
