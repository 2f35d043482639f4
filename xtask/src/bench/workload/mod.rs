//! Workloads as deterministic request plans.
//!
//! A [`Plan`] is a pure function of the workload, the rate, the durations and
//! the seed: every policy replays the same arrivals with the same prompts.
//! Multi-turn conversations append the engine's answers to their history;
//! the simulator answers a prompt identically on every engine (same seed,
//! same prompt, same output), so those histories are identical too, which
//! each run's fingerprint checks.
//!
//! Prompts are words of the word-level tokenizer (`w0`…`w65535`, one token
//! each). Sizes are given in real tokens (as llm-d publishes them) and
//! divided by the token scale `k` (see [`Scale`]).

use serde::Serialize;

mod plan;

pub(crate) use plan::{
    Arrival, Body, LORA_ADAPTER_LABEL, LORA_BASE_LABEL, Plan, SplitMix, TwoTenants, plan, words,
};
use plan::{LORA_ADAPTERS, lora_adapters};

/// The word-level tokenizer's vocabulary of words.
const WORDS: u64 = 65_536;

/// How the benchmark shrinks the workload to fit two cores: token counts
/// ÷ `k`, per-token costs × `k`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub(crate) struct Scale {
    pub k: u32,
}

impl Scale {
    /// `real` tokens in scaled tokens (at least 1).
    pub(crate) fn tokens(self, real: u32) -> u32 {
        (real / self.k.max(1)).max(1)
    }
}

/// The workloads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum WorkloadKind {
    /// llm-d's shared-prefix workload: groups of users sharing a long system
    /// prompt, each user asking the same question again.
    SharedPrefix,
    /// Chats whose history grows each turn.
    MultiTurn,
    /// Every prompt distinct: routing can only balance load.
    NoReuse,
    /// The shared-prefix prompts on a fleet of two speeds (a quarter of the
    /// engines 3× slower; the router is not told).
    Heterogeneous,
    /// Agent/tool sessions replayed from a Mooncake-format trace (a file,
    /// or a synthetic one from the seed), on the two-speed fleet.
    Agent,
    /// The shared-prefix prompts in on/off bursts: 2 s at 4× the rate, 6 s
    /// of silence.
    Bursts,
    /// Long shared documents whose resident set is about 3× the fleet's
    /// KV: heavy eviction.
    LongContext,
    /// Past the knee: distinct prompts (the knee is the real one) at
    /// 1.5, 2 and 3 × the knee; goodput (TTFT ≤ 2 s) is the figure.
    Overload,
    /// A 150-request burst within a second on a fleet whose last engine
    /// is 10× slower (the router is not told): the slow engine's share.
    SlowBurst,
    /// Two tenants, distinct prompts: a light one alone, then with a heavy
    /// one at 10× its rate, together past the knee (`x-kinference-tenant`):
    /// the light tenant's TTFT with the heavy one against alone.
    TwoTenants,
    /// The shared-prefix prompts split between the base model (40 %) and
    /// 8 LoRA adapters (60 %, Zipf-skewed), on engines holding at most 2
    /// adapters per running batch: slot contention.
    Lora,
}

impl WorkloadKind {
    pub(crate) const ALL: [Self; 11] = [
        Self::SharedPrefix,
        Self::MultiTurn,
        Self::NoReuse,
        Self::Heterogeneous,
        Self::Agent,
        Self::Bursts,
        Self::LongContext,
        Self::Overload,
        Self::SlowBurst,
        Self::TwoTenants,
        Self::Lora,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::SharedPrefix => "shared-prefix",
            Self::MultiTurn => "multi-turn",
            Self::NoReuse => "no-reuse",
            Self::Heterogeneous => "heterogeneous",
            Self::Agent => "agent",
            Self::Bursts => "bursts",
            Self::LongContext => "long-context",
            Self::Overload => "overload",
            Self::SlowBurst => "slow-burst",
            Self::TwoTenants => "two-tenants",
            Self::Lora => "lora",
        }
    }

    /// The simulator flags this workload's engines need besides the
    /// fleet's: the LoRA workload's adapters (`--lora-modules`, every
    /// engine serving all of them) and its GPU slots (`--max-loras`).
    pub(crate) fn engine_args(self) -> Vec<String> {
        match Workload::of(self) {
            Workload::Lora {
                adapters,
                max_loras,
                ..
            } => vec![
                "--lora-modules".to_owned(),
                lora_adapters(adapters).join(","),
                "--max-loras".into(),
                max_loras.to_string(),
            ],
            _ => Vec::new(),
        }
    }

    /// Each engine's step-time multiplier (the simulator's `--slowdown`):
    /// on the two-speed fleets the last quarter (at least one) is 3× slower;
    /// on the slow-burst fleet the last engine is `burst` times slower
    /// ([`SLOW_BURST_SLOWDOWN`] by default; 1: no slow engine).
    pub(crate) fn slowdowns(self, engines: usize, burst: f64) -> Vec<f64> {
        if self == Self::SlowBurst {
            return (0..engines)
                .map(|i| {
                    if engines > 1 && i == engines - 1 {
                        burst
                    } else {
                        1.0
                    }
                })
                .collect();
        }
        let slow = match self {
            Self::Heterogeneous | Self::Agent if engines > 1 => (engines / 4).max(1),
            _ => 0,
        };
        (0..engines)
            .map(|i| if i >= engines - slow { 3.0 } else { 1.0 })
            .collect()
    }
}

/// The slow-burst fleet's last engine is this many times slower
/// (`--burst-slowdown`).
pub(crate) const SLOW_BURST_SLOWDOWN: f64 = 10.0;

/// A workload's shape in real tokens.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub(crate) enum Workload {
    /// `groups` × `prompts_per_group` distinct prompts (system prompt of the
    /// group + the user's question); each arrival picks one uniformly.
    SharedPrefix {
        groups: u32,
        prompts_per_group: u32,
        system_tokens: u32,
        question_tokens: u32,
        output_tokens: u32,
    },
    /// `groups` × `users_per_group` conversations; a group shares a system
    /// prompt; each turn adds `user_tokens` and the answer; after `turns`
    /// turns a conversation starts over with a new user. Conversations start
    /// staggered at turns 0..turns with a synthetic earlier history, so the
    /// run is in steady state from the start.
    MultiTurn {
        groups: u32,
        users_per_group: u32,
        system_tokens: u32,
        user_tokens: u32,
        output_tokens: u32,
        turns: u32,
    },
    /// A fresh random prompt per request.
    NoReuse {
        prompt_tokens: u32,
        output_tokens: u32,
    },
    /// Shared-prefix prompts arriving in bursts: Poisson at `rate × (on +
    /// off) ÷ on` during `on_ms`, nothing during `off_ms`.
    Bursts {
        groups: u32,
        prompts_per_group: u32,
        system_tokens: u32,
        question_tokens: u32,
        output_tokens: u32,
        on_ms: u32,
        off_ms: u32,
    },
    /// Shared-prefix groups, each belonging to the base model or to one of
    /// `adapters` LoRA adapters ([`LORA_ADAPTERS`]): an arrival goes to the
    /// base model with probability `base_percent` %, else to adapter k
    /// (counted from 1) with probability ∝ 1/k (Zipf, s = 1); then to one of
    /// its model's groups and prompts uniformly. A model's groups are in
    /// proportion to its share of the requests (at least one each; see
    /// [`lora_groups`]). Every engine serves every adapter, at most
    /// `max_loras` per running batch.
    Lora {
        groups: u32,
        prompts_per_group: u32,
        system_tokens: u32,
        question_tokens: u32,
        output_tokens: u32,
        adapters: u32,
        base_percent: u32,
        max_loras: u32,
    },
    /// A trace (see [`super::trace`]): its mean input and never-seen tokens.
    Trace {
        requests: usize,
        mean_input_tokens: f64,
        mean_new_tokens: f64,
        output_tokens: f64,
    },
}

impl Workload {
    /// The benchmark's definition of each workload, in real tokens.
    pub(crate) fn of(kind: WorkloadKind) -> Self {
        match kind {
            // llm-d's published shared-prefix benchmark (inference-perf
            // `shared_prefix`: 150 groups × 5 prompts, 6,000-token system
            // prompt, 1,200-token question, 1,000-token answer).
            WorkloadKind::SharedPrefix => Self::SharedPrefix {
                groups: 150,
                prompts_per_group: 5,
                system_tokens: 6_000,
                question_tokens: 1_200,
                output_tokens: 1_000,
            },
            // Sized like the shared-prefix workload: its resident set is
            // about 75 % of the fleet's KV at llm-d's capacity.
            WorkloadKind::MultiTurn => Self::MultiTurn {
                groups: 40,
                users_per_group: 16,
                system_tokens: 2_000,
                user_tokens: 400,
                output_tokens: 300,
                turns: 8,
            },
            WorkloadKind::NoReuse => Self::NoReuse {
                prompt_tokens: 7_200,
                output_tokens: 1_000,
            },
            WorkloadKind::Heterogeneous => Self::of(WorkloadKind::SharedPrefix),
            WorkloadKind::Overload | WorkloadKind::TwoTenants => Self::of(WorkloadKind::NoReuse),
            // Prompts that one engine prefills in ~0.2 s, short answers: the
            // burst is about where requests go before any first token.
            WorkloadKind::SlowBurst => Self::NoReuse {
                prompt_tokens: 2_000,
                output_tokens: 200,
            },
            WorkloadKind::Bursts => Self::Bursts {
                groups: 150,
                prompts_per_group: 5,
                system_tokens: 6_000,
                question_tokens: 1_200,
                output_tokens: 1_000,
                on_ms: 2_000,
                off_ms: 6_000,
            },
            // 300 documents of 20,000 tokens, two 2,000-token questions each:
            // 7.2M resident tokens, 2.9× llm-d's 8-pod KV.
            WorkloadKind::LongContext => Self::SharedPrefix {
                groups: 300,
                prompts_per_group: 2,
                system_tokens: 20_000,
                question_tokens: 2_000,
                output_tokens: 500,
            },
            // The shared-prefix prompts (llm-d's sizes) over the base model
            // and 8 adapters, 2 GPU slots per engine (fewer than adapters,
            // as fleets run them).
            WorkloadKind::Lora => Self::Lora {
                groups: 150,
                prompts_per_group: 5,
                system_tokens: 6_000,
                question_tokens: 1_200,
                output_tokens: 1_000,
                adapters: LORA_ADAPTERS.len() as u32,
                base_percent: 40,
                max_loras: 2,
            },
            // Replaced by the trace's own figures when it is loaded.
            WorkloadKind::Agent => Self::Trace {
                requests: 0,
                mean_input_tokens: 1.0,
                mean_new_tokens: 1.0,
                output_tokens: 300.0,
            },
        }
    }

    /// The workload with `p`× fewer groups (at least one), for a fleet with
    /// `p`× less KV: the resident set keeps its share of the fleet's KV and
    /// the caches warm `p`× sooner.
    pub(crate) fn with_population(mut self, p: u32) -> Self {
        match &mut self {
            Self::SharedPrefix { groups, .. }
            | Self::MultiTurn { groups, .. }
            | Self::Bursts { groups, .. } => {
                *groups = (*groups / p.max(1)).max(1);
            }
            // Every model keeps a group of its own.
            Self::Lora {
                groups, adapters, ..
            } => *groups = (*groups / p.max(1)).max(*adapters + 1),
            Self::NoReuse { .. } | Self::Trace { .. } => {}
        }
        self
    }

    /// Mean prompt tokens per request (real), for the knee.
    pub(crate) fn mean_prompt_tokens(&self) -> f64 {
        match *self {
            Self::SharedPrefix {
                system_tokens,
                question_tokens,
                ..
            }
            | Self::Bursts {
                system_tokens,
                question_tokens,
                ..
            }
            | Self::Lora {
                system_tokens,
                question_tokens,
                ..
            } => f64::from(system_tokens + question_tokens),
            Self::Trace {
                mean_input_tokens, ..
            } => mean_input_tokens,
            Self::MultiTurn {
                system_tokens,
                user_tokens,
                output_tokens,
                turns,
                ..
            } => {
                // Turn t carries t earlier exchanges.
                let mean_history = f64::from(turns - 1) / 2.0;
                f64::from(system_tokens)
                    + f64::from(user_tokens)
                    + mean_history * f64::from(user_tokens + output_tokens)
            }
            Self::NoReuse { prompt_tokens, .. } => f64::from(prompt_tokens),
        }
    }

    /// Mean prompt tokens per request that no routing can avoid computing
    /// (real), for the knee with perfect reuse: new text only.
    pub(crate) fn mean_new_tokens(&self) -> f64 {
        match *self {
            // Exact repeats: in steady state only the last token.
            Self::SharedPrefix { .. } | Self::Bursts { .. } | Self::Lora { .. } => 1.0,
            Self::Trace {
                mean_new_tokens, ..
            } => mean_new_tokens,
            Self::MultiTurn { user_tokens, .. } => f64::from(user_tokens),
            Self::NoReuse { prompt_tokens, .. } => f64::from(prompt_tokens),
        }
    }

    /// KV tokens the workload keeps resident with perfect placement (real).
    pub(crate) fn resident_tokens(&self) -> f64 {
        match *self {
            Self::SharedPrefix {
                groups,
                prompts_per_group,
                system_tokens,
                question_tokens,
                ..
            }
            | Self::Bursts {
                groups,
                prompts_per_group,
                system_tokens,
                question_tokens,
                ..
            }
            | Self::Lora {
                groups,
                prompts_per_group,
                system_tokens,
                question_tokens,
                ..
            } => f64::from(groups) * f64::from(system_tokens + prompts_per_group * question_tokens),
            Self::Trace {
                requests,
                mean_new_tokens,
                ..
            } => requests as f64 * mean_new_tokens,
            Self::MultiTurn {
                groups,
                users_per_group,
                system_tokens,
                user_tokens,
                output_tokens,
                turns,
            } => {
                let convs = f64::from(groups * users_per_group);
                f64::from(groups) * f64::from(system_tokens)
                    + convs * f64::from(turns) / 2.0 * f64::from(user_tokens + output_tokens)
            }
            Self::NoReuse { .. } => 0.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::plan::{arrival_times, burst_times, lora_groups, lora_shares};
    use super::*;

    #[test]
    fn two_tenants_send_the_light_one_alone_then_both_at_ten_to_one() {
        let phases = TwoTenants {
            warmup: Duration::from_secs(5),
            alone: Duration::from_secs(100),
            together: Duration::from_secs(100),
        };
        let w = Workload::of(WorkloadKind::TwoTenants);
        let p = phases.plan(&w, Scale { k: 10 }, 22.0, 3);
        assert_eq!(p, phases.plan(&w, Scale { k: 10 }, 22.0, 3));
        assert_eq!(p.warmup, Duration::from_secs(105));
        let count = |prefix: &str| {
            p.arrivals
                .iter()
                .filter(|a| a.label.starts_with(prefix))
                .count() as f64
        };
        // 2 per second for the light tenant, 20 for the heavy one.
        assert!((count(TwoTenants::LIGHT_ALONE) - 200.0).abs() < 45.0);
        assert!((count(TwoTenants::LIGHT_WITH) - 200.0).abs() < 45.0);
        assert!((count(TwoTenants::HEAVY_LABEL) - 2000.0).abs() < 150.0);
        for a in &p.arrivals {
            let heavy = a.label.starts_with(TwoTenants::HEAVY_LABEL);
            assert_eq!(
                a.tenant,
                Some(if heavy { "heavy" } else { "light" }),
                "{}",
                a.label
            );
            assert!(!heavy || a.at >= p.warmup, "{}", a.label);
            assert_eq!(
                a.label.starts_with(TwoTenants::LIGHT_ALONE),
                !heavy && a.at >= phases.warmup && a.at < p.warmup
            );
        }
        assert!(p.arrivals.windows(2).all(|x| x[0].at <= x[1].at));
        assert!(p.arrivals.iter().enumerate().all(|(i, a)| a.index == i));
    }

    /// `kind`'s plan at `rate` with `warmup` + `measure` seconds.
    fn plan_at(kind: WorkloadKind, seed: u64, rate: f64, warmup: u64, measure: u64) -> Plan {
        plan(
            &Workload::of(kind).with_population(5),
            Scale { k: 10 },
            rate,
            Duration::from_secs(warmup),
            Duration::from_secs(measure),
            seed,
        )
    }

    fn plan_of(kind: WorkloadKind, seed: u64) -> Plan {
        plan_at(kind, seed, 8.0, 5, 20)
    }

    #[test]
    fn plans_are_identical_for_a_seed_and_differ_across_seeds() {
        // The agent workload is planned from its trace (see `trace`).
        for kind in WorkloadKind::ALL
            .into_iter()
            .filter(|k| *k != WorkloadKind::Agent && *k != WorkloadKind::TwoTenants)
        {
            let a = plan_of(kind, 7);
            assert_eq!(a, plan_of(kind, 7), "{kind:?}");
            assert_ne!(a, plan_of(kind, 8), "{kind:?}");
            assert!(!a.arrivals.is_empty());
        }
    }

    /// A long LoRA plan (about 10,000 arrivals).
    fn lora_plan(seed: u64) -> Plan {
        plan_at(WorkloadKind::Lora, seed, 50.0, 10, 190)
    }

    #[test]
    fn lora_plans_are_identical_for_a_seed_and_differ_across_seeds() {
        let a = lora_plan(7);
        assert_eq!(a, lora_plan(7));
        let b = lora_plan(8);
        assert_ne!(a, b);
        // Not only the times: which model each request names differs too.
        let models = |p: &Plan| p.arrivals.iter().map(|a| a.model).collect::<Vec<_>>();
        assert_ne!(models(&a)[..1000], models(&b)[..1000]);
    }

    #[test]
    fn lora_sends_forty_percent_to_the_base_model_and_a_zipf_share_to_each_adapter() {
        let p = lora_plan(3);
        let n = p.arrivals.len() as f64;
        assert!((n - 10_000.0).abs() < 400.0, "{n}");
        let count = |m: Option<&str>| p.arrivals.iter().filter(|a| a.model == m).count() as f64;
        let base = count(None) / n;
        assert!((base - 0.4).abs() < 0.02, "base share {base}");
        let adapters: Vec<f64> = LORA_ADAPTERS.iter().map(|a| count(Some(a))).collect();
        let total: f64 = adapters.iter().sum();
        assert!(
            (total + count(None) - n).abs() < 0.5,
            "only the base model and the adapters"
        );
        // Adapter k gets 1/k ÷ H(8) of the adapter requests: the hottest
        // 37 %, the two hottest 55 %, the rarest under 5 %.
        let h8: f64 = (1..=8).map(|k| 1.0 / f64::from(k)).sum();
        for (k, c) in adapters.iter().enumerate() {
            let expected = total / (k as f64 + 1.0) / h8;
            assert!(
                (c - expected).abs() < 4.0 * expected.sqrt() + 10.0,
                "lora-{}: {c} vs {expected:.0}",
                k + 1
            );
        }
        assert!((adapters[0] + adapters[1]) / total > 0.5, "{adapters:?}");
        assert!(adapters[7] / total < 0.06, "{adapters:?}");
        assert!(adapters[0] > 6.0 * adapters[7], "{adapters:?}");
    }

    #[test]
    fn lora_requests_name_only_the_engines_adapters_and_a_group_keeps_its_model() {
        let args = WorkloadKind::Lora.engine_args();
        let i = args
            .iter()
            .position(|a| a == "--lora-modules")
            .expect("--lora-modules");
        let served: Vec<&str> = args[i + 1].split(',').collect();
        assert_eq!(served.len(), 8);
        let mut group_model = std::collections::HashMap::new();
        for a in &lora_plan(5).arrivals {
            let group = a.label.rsplit_once('-').map_or(&a.label[..], |(_, g)| g);
            let group = group.split('p').next().expect("g<n>p<m>");
            assert!(group.starts_with('g'), "{}", a.label);
            match a.model {
                Some(m) => {
                    assert!(served.contains(&m), "{m} is not served");
                    assert!(m.starts_with(LORA_ADAPTER_LABEL));
                    assert!(a.label.starts_with(&format!("{m}-g")), "{}", a.label);
                }
                None => assert!(a.label.starts_with(LORA_BASE_LABEL), "{}", a.label),
            }
            let first = *group_model.entry(group.to_owned()).or_insert(a.model);
            assert_eq!(first, a.model, "group {group} under two models");
        }
        // 30 groups at population 5, every one of them sent to.
        assert_eq!(group_model.len(), 30);
    }

    #[test]
    fn lora_groups_follow_the_shares_with_one_at_least() {
        let shares = lora_shares(8, 40);
        assert!((shares.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        assert!((shares[0] - 0.4).abs() < 1e-12);
        assert!(shares[1..].windows(2).all(|w| w[0] > w[1]));
        // 12 base groups, 18 over the adapters by 1/k: 6.6, 3.3, 2.2, 1.7,
        // 1.3, 1.1, 0.95, 0.83.
        assert_eq!(lora_groups(30, &shares), [12, 7, 3, 2, 2, 1, 1, 1, 1]);
        assert_eq!(lora_groups(150, &shares).iter().sum::<u32>(), 150);
        assert_eq!(lora_groups(3, &shares), [1; 9]);
        // A population too small for a group per model keeps one each.
        let w = Workload::of(WorkloadKind::Lora).with_population(1000);
        assert!(matches!(w, Workload::Lora { groups: 9, .. }), "{w:?}");
    }

    #[test]
    fn only_the_lora_workload_gives_its_engines_adapters_and_names_them() {
        assert_eq!(
            WorkloadKind::Lora.engine_args(),
            [
                "--lora-modules",
                "lora-1,lora-2,lora-3,lora-4,lora-5,lora-6,lora-7,lora-8",
                "--max-loras",
                "2"
            ]
        );
        for kind in WorkloadKind::ALL
            .into_iter()
            .filter(|k| *k != WorkloadKind::Lora)
        {
            assert!(kind.engine_args().is_empty(), "{kind:?}");
            if kind != WorkloadKind::Agent && kind != WorkloadKind::TwoTenants {
                assert!(plan_of(kind, 3).arrivals.iter().all(|a| a.model.is_none()));
            }
        }
        assert!(
            LORA_ADAPTERS
                .iter()
                .all(|a| a.starts_with(LORA_ADAPTER_LABEL))
        );
        assert_eq!(WorkloadKind::Lora.name(), "lora");
        assert!(WorkloadKind::ALL.contains(&WorkloadKind::Lora));
    }

    #[test]
    fn arrivals_are_poisson_at_the_rate() {
        let t = arrival_times(50.0, Duration::from_secs(200), 1);
        let n = t.len() as f64;
        // 10,000 expected; a Poisson count's sd is 100.
        assert!((n - 10_000.0).abs() < 400.0, "{n}");
        assert!(t.windows(2).all(|w| w[0] <= w[1]));
        assert!(t.last().is_some_and(|l| *l < Duration::from_secs(200)));
        // Exponential gaps: the mean gap is 1/rate and about 36.8 % exceed it.
        let gaps: Vec<f64> = t
            .windows(2)
            .map(|w| w[1].saturating_sub(w[0]).as_secs_f64())
            .collect();
        let over = gaps.iter().filter(|g| **g > 0.02).count() as f64 / gaps.len() as f64;
        assert!((over - (-1.0f64).exp()).abs() < 0.02, "{over}");
    }

    #[test]
    fn shared_prefix_prompts_share_their_group_prefix_at_scale() {
        let p = plan_of(WorkloadKind::SharedPrefix, 3);
        let prompts: Vec<&str> = p
            .arrivals
            .iter()
            .map(|a| match &a.body {
                Body::Completion { prompt, max_tokens } => {
                    assert_eq!(*max_tokens, 100);
                    prompt.as_str()
                }
                Body::ChatTurn { .. } => panic!("completions expected"),
            })
            .collect();
        for pr in &prompts {
            assert_eq!(pr.split(' ').count(), 600 + 120);
        }
        // 30 × 5 distinct prompts; 200 arrivals repeat some and share
        // system prompts within a group (600 words).
        let systems: std::collections::HashSet<String> = prompts
            .iter()
            .map(|p| p.split(' ').take(600).collect::<Vec<_>>().join(" "))
            .collect();
        assert_eq!(systems.len(), 30);
        let distinct: std::collections::HashSet<&&str> = prompts.iter().collect();
        assert!(distinct.len() <= 150 && distinct.len() < prompts.len());
    }

    #[test]
    fn no_reuse_prompts_are_distinct() {
        let p = plan_of(WorkloadKind::NoReuse, 3);
        let firsts: std::collections::HashSet<String> = p
            .arrivals
            .iter()
            .map(|a| match &a.body {
                Body::Completion { prompt, .. } => prompt.split(' ').take(4).collect::<String>(),
                Body::ChatTurn { .. } => panic!("completions expected"),
            })
            .collect();
        assert_eq!(firsts.len(), p.arrivals.len());
    }

    #[test]
    fn multi_turn_visits_conversations_in_a_cycle_and_restarts_each_once() {
        let p = plan_of(WorkloadKind::MultiTurn, 3);
        assert_eq!(p.conversations, 128);
        let mut seen = vec![0usize; 128];
        for a in &p.arrivals {
            let Body::ChatTurn {
                conversation,
                restart,
                user,
                max_tokens,
            } = &a.body
            else {
                panic!("chat expected")
            };
            assert_eq!(user.split(' ').count(), 40);
            assert_eq!(*max_tokens, 30);
            // The first visit carries the (staggered) history; later ones
            // only when the conversation starts over.
            if seen[*conversation] == 0 {
                let m = restart.as_ref().expect("first visit restarts");
                assert_eq!(m.len(), 1 + 2 * (*conversation % 8));
            }
            seen[*conversation] += 1;
        }
        let (lo, hi) = (seen.iter().min(), seen.iter().max());
        assert!(hi.zip(lo).is_some_and(|(h, l)| h - l <= 1), "{seen:?}");
    }

    #[test]
    fn bursts_keep_the_mean_rate_and_stay_in_their_on_windows() {
        let (on, off) = (Duration::from_secs(2), Duration::from_secs(6));
        let t = burst_times(5.0, Duration::from_secs(400), 3, on, off);
        let n = t.len() as f64;
        assert!((n / 400.0 - 5.0).abs() < 0.5, "{n}");
        assert!(t.iter().all(|t| t.as_secs_f64() % 8.0 < 2.0));
        assert!(t.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn two_speed_fleets_slow_a_quarter() {
        assert_eq!(
            WorkloadKind::Heterogeneous.slowdowns(8, SLOW_BURST_SLOWDOWN),
            [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0, 3.0]
        );
        assert_eq!(
            WorkloadKind::Agent.slowdowns(2, SLOW_BURST_SLOWDOWN),
            [1.0, 3.0]
        );
        assert!(
            WorkloadKind::SharedPrefix
                .slowdowns(8, SLOW_BURST_SLOWDOWN)
                .iter()
                .all(|s| (*s - 1.0).abs() < 1e-12)
        );
    }

    #[test]
    fn scale_divides_tokens_and_keeps_at_least_one() {
        let s = Scale { k: 10 };
        assert_eq!(s.tokens(6_000), 600);
        assert_eq!(s.tokens(5), 1);
        assert_eq!(Scale { k: 1 }.tokens(1_200), 1_200);
    }

    #[test]
    fn the_shared_prefix_working_set_is_llm_d_s() {
        let w = Workload::of(WorkloadKind::SharedPrefix);
        assert!((w.resident_tokens() - 1_800_000.0).abs() < 1e-6);
        assert!((w.mean_prompt_tokens() - 7_200.0).abs() < 1e-6);
        let small = w.with_population(5);
        assert!((small.resident_tokens() - 360_000.0).abs() < 1e-6);
        // Multi-turn's resident set is about as large.
        let m = Workload::of(WorkloadKind::MultiTurn);
        assert!(
            (m.resident_tokens() / w.resident_tokens() - 1.0).abs() < 0.1,
            "{}",
            m.resident_tokens()
        );
    }
}
