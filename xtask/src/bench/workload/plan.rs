//! A workload's request plan: the arrivals (Poisson, bursts, a trace),
//! their bodies, the multi-turn histories, the LoRA adapters' shares and
//! the two-tenant phases.

use std::time::Duration;

use serde_json::{Value, json};

use super::{Scale, WORDS, Workload};

/// What one arrival sends.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Body {
    /// `/v1/completions` with this prompt.
    Completion { prompt: String, max_tokens: u32 },
    /// `/v1/chat/completions`: a turn of `conversation`. With `restart`, the
    /// conversation's history is first replaced by these messages.
    ChatTurn {
        conversation: usize,
        restart: Option<Vec<Value>>,
        user: String,
        max_tokens: u32,
    },
}

/// One request of a plan.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Arrival {
    /// Position in the plan.
    pub index: usize,
    /// When to send it, from the start of the run.
    pub at: Duration,
    pub body: Body,
    /// What it is, for per-request analysis: `g3p1` (group 3, prompt 1),
    /// `c12t4` (conversation 12, turn 4), `n17`, `light-alone-n3`.
    pub label: String,
    /// The tenant it is sent as (`x-kinference-tenant`), if any.
    pub tenant: Option<&'static str>,
    /// The `model` it names when not the base model's: a LoRA adapter
    /// (each adapter's prefix cache is its own).
    pub model: Option<&'static str>,
}

/// A run's requests: arrivals in `[0, warmup + measure)`; those before
/// `warmup` warm the caches and are not counted.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Plan {
    pub arrivals: Vec<Arrival>,
    pub warmup: Duration,
    pub measure: Duration,
    /// Conversations (multi-turn), 0 otherwise.
    pub conversations: usize,
}

/// SplitMix64: small, seedable, stable.
#[derive(Clone, Debug)]
pub(crate) struct SplitMix(pub u64);

impl SplitMix {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub(crate) fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
}

/// `n` pseudo-random words drawn from a generator seeded by `key`.
pub(crate) fn words(key: u64, n: u32) -> String {
    let mut rng = SplitMix(key ^ 0x5157_4f52_4453);
    let mut s = String::with_capacity(n as usize * 6);
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push('w');
        s.push_str(&(rng.next() % WORDS).to_string());
    }
    s
}

/// A key for `words` from a namespace and two indices.
fn key(space: u64, a: u64, b: u64) -> u64 {
    let mut r =
        SplitMix(space.wrapping_mul(0x100_0000_01B3) ^ a.rotate_left(21) ^ b.rotate_left(42));
    r.next()
}

/// Poisson arrival times at `rate` per second in `[0, total)`.
pub(crate) fn arrival_times(rate: f64, total: Duration, seed: u64) -> Vec<Duration> {
    let mut rng = SplitMix(seed ^ 0xA221_7A15);
    let mut t = 0.0;
    let end = total.as_secs_f64();
    let mut out = Vec::new();
    if rate <= 0.0 {
        return out;
    }
    loop {
        t += -(1.0 - rng.unit()).ln() / rate;
        if t >= end {
            return out;
        }
        out.push(Duration::from_secs_f64(t));
    }
}

/// On/off arrivals: Poisson at `rate × (on + off) ÷ on` during the first
/// `on` of every `on + off`, none in the rest; mean rate `rate`.
pub(crate) fn burst_times(
    rate: f64,
    total: Duration,
    seed: u64,
    on: Duration,
    off: Duration,
) -> Vec<Duration> {
    let period = (on + off).as_secs_f64();
    let on_s = on.as_secs_f64().max(1e-3);
    // Poisson at the burst rate over the "on" time only, laid out on the
    // clock period by period.
    let on_total = Duration::from_secs_f64(total.as_secs_f64() / period * on_s + on_s);
    arrival_times(rate * period / on_s, on_total, seed)
        .into_iter()
        .map(|t| {
            let t = t.as_secs_f64();
            let k = (t / on_s).floor();
            Duration::from_secs_f64(k * period + (t - k * on_s))
        })
        .filter(|t| *t < total)
        .collect()
}

/// The plan of `workload` (real tokens, scaled by `scale`) at `rate`.
pub(crate) fn plan(
    workload: &Workload,
    scale: Scale,
    rate: f64,
    warmup: Duration,
    measure: Duration,
    seed: u64,
) -> Plan {
    let times = match *workload {
        Workload::Bursts { on_ms, off_ms, .. } => burst_times(
            rate,
            warmup + measure,
            seed,
            Duration::from_millis(u64::from(on_ms)),
            Duration::from_millis(u64::from(off_ms)),
        ),
        _ => arrival_times(rate, warmup + measure, seed),
    };
    let mut pick = SplitMix(seed ^ 0x0C40_1CE5);
    let mut arrivals = Vec::with_capacity(times.len());
    let mut conversations = 0;
    match *workload {
        Workload::SharedPrefix {
            groups,
            prompts_per_group,
            system_tokens,
            question_tokens,
            output_tokens,
        }
        | Workload::Bursts {
            groups,
            prompts_per_group,
            system_tokens,
            question_tokens,
            output_tokens,
            ..
        } => {
            let (sys, q, out) = (
                scale.tokens(system_tokens),
                scale.tokens(question_tokens),
                scale.tokens(output_tokens),
            );
            for (index, at) in times.into_iter().enumerate() {
                let g = pick.below(u64::from(groups));
                let p = pick.below(u64::from(prompts_per_group));
                let prompt = format!("{} {}", words(key(1, g, 0), sys), words(key(2, g, p), q));
                arrivals.push(Arrival {
                    index,
                    at,
                    body: Body::Completion {
                        prompt,
                        max_tokens: out,
                    },
                    label: format!("g{g}p{p}"),
                    tenant: None,
                    model: None,
                });
            }
        }
        Workload::NoReuse {
            prompt_tokens,
            output_tokens,
        } => {
            let (n, out) = (scale.tokens(prompt_tokens), scale.tokens(output_tokens));
            for (index, at) in times.into_iter().enumerate() {
                let prompt = words(key(3, seed, index as u64), n);
                arrivals.push(Arrival {
                    index,
                    at,
                    body: Body::Completion {
                        prompt,
                        max_tokens: out,
                    },
                    label: format!("n{index}"),
                    tenant: None,
                    model: None,
                });
            }
        }
        Workload::MultiTurn {
            groups,
            users_per_group,
            system_tokens,
            user_tokens,
            output_tokens,
            turns,
        } => {
            let (sys, user, out) = (
                scale.tokens(system_tokens),
                scale.tokens(user_tokens),
                scale.tokens(output_tokens),
            );
            let n = (groups * users_per_group) as usize;
            conversations = n;
            let turns = turns.max(1);
            // A fixed visiting order: conversation order[i % n] takes arrival i.
            let mut order: Vec<usize> = (0..n).collect();
            for i in (1..n).rev() {
                let j = pick.below(i as u64 + 1) as usize;
                order.swap(i, j);
            }
            // Per conversation: the user generation and the next turn.
            let mut generation = vec![0u64; n];
            let mut turn: Vec<u32> = (0..n).map(|c| c as u32 % turns).collect();
            let mut started = vec![false; n];
            for (index, at) in times.into_iter().enumerate() {
                let c = order[index % n];
                let group = c as u64 / u64::from(users_per_group);
                if turn[c] >= turns {
                    turn[c] = 0;
                    generation[c] += 1;
                    started[c] = false;
                }
                let user_id = (c as u64) << 20 | generation[c];
                let restart = (!started[c]).then(|| {
                    let mut m = vec![json!({"role": "system", "content": words(key(4, group, 0), sys)})];
                    // A synthetic earlier history for staggered starts.
                    for t in 0..turn[c] {
                        m.push(json!({"role": "user", "content": words(key(5, user_id, u64::from(t)), user)}));
                        m.push(json!({"role": "assistant", "content": words(key(6, user_id, u64::from(t)), out)}));
                    }
                    m
                });
                started[c] = true;
                arrivals.push(Arrival {
                    index,
                    at,
                    body: Body::ChatTurn {
                        conversation: c,
                        restart,
                        user: words(key(5, user_id, u64::from(turn[c])), user),
                        max_tokens: out,
                    },
                    label: format!("c{c}t{}", turn[c]),
                    tenant: None,
                    model: None,
                });
                turn[c] += 1;
            }
        }
        Workload::Lora {
            groups,
            prompts_per_group,
            system_tokens,
            question_tokens,
            output_tokens,
            adapters,
            base_percent,
            ..
        } => {
            let (sys, q, out) = (
                scale.tokens(system_tokens),
                scale.tokens(question_tokens),
                scale.tokens(output_tokens),
            );
            let names = lora_adapters(adapters);
            let shares = lora_shares(names.len(), base_percent);
            let counts = lora_groups(groups, &shares);
            // Model m's groups are firsts[m]..firsts[m] + counts[m].
            let firsts: Vec<u32> = counts
                .iter()
                .scan(0, |next, c| {
                    let first = *next;
                    *next += c;
                    Some(first)
                })
                .collect();
            for (index, at) in times.into_iter().enumerate() {
                // Model `chosen` (0: the base model, k: adapter k).
                let mut draw = pick.unit();
                let mut chosen = shares.len() - 1;
                for (i, share) in shares.iter().enumerate() {
                    if draw < *share {
                        chosen = i;
                        break;
                    }
                    draw -= share;
                }
                let g = u64::from(firsts[chosen]) + pick.below(u64::from(counts[chosen]));
                let p = pick.below(u64::from(prompts_per_group));
                let prompt = format!("{} {}", words(key(8, g, 0), sys), words(key(9, g, p), q));
                let (label, model) = match chosen.checked_sub(1).map(|a| names[a]) {
                    Some(name) => (format!("{name}-g{g}p{p}"), Some(name)),
                    None => (format!("{LORA_BASE_LABEL}g{g}p{p}"), None),
                };
                arrivals.push(Arrival {
                    index,
                    at,
                    body: Body::Completion {
                        prompt,
                        max_tokens: out,
                    },
                    label,
                    tenant: None,
                    model,
                });
            }
        }
        // Traces are planned by `super::trace::plan`.
        Workload::Trace { .. } => {}
    }
    Plan {
        arrivals,
        warmup,
        measure,
        conversations,
    }
}

/// The LoRA workload's adapters, hottest first (each engine's
/// `--lora-modules`; a request for one names it as its `model`).
pub(crate) const LORA_ADAPTERS: [&str; 8] = [
    "lora-1", "lora-2", "lora-3", "lora-4", "lora-5", "lora-6", "lora-7", "lora-8",
];
/// Label prefixes of the LoRA workload's requests: the base model's, and
/// every adapter's (each adapter's name starts with it).
pub(crate) const LORA_BASE_LABEL: &str = "base-";
pub(crate) const LORA_ADAPTER_LABEL: &str = "lora-";

/// The first `n` of [`LORA_ADAPTERS`] (at least one).
pub(crate) fn lora_adapters(n: u32) -> &'static [&'static str] {
    &LORA_ADAPTERS[..(n as usize).clamp(1, LORA_ADAPTERS.len())]
}

/// Each model's share of the requests, the base model's first: `base_percent`
/// %, then adapter k (from 1) ∝ 1/k (Zipf, s = 1). Sums to 1.
pub(crate) fn lora_shares(adapters: usize, base_percent: u32) -> Vec<f64> {
    let base = f64::from(base_percent.min(100)) / 100.0;
    let harmonic: f64 = (1..=adapters).map(|k| 1.0 / k as f64).sum();
    std::iter::once(base)
        .chain((1..=adapters).map(|k| (1.0 - base) / k as f64 / harmonic))
        .collect()
}

/// Groups per model (in [`lora_shares`] order): `groups` in proportion to
/// the shares by largest remainder, at least one each, so every group gets
/// about the same rate.
pub(crate) fn lora_groups(groups: u32, shares: &[f64]) -> Vec<u32> {
    let groups = groups.max(shares.len() as u32);
    let ideal: Vec<f64> = shares.iter().map(|s| s * f64::from(groups)).collect();
    let mut counts: Vec<u32> = ideal.iter().map(|x| (x.floor() as u32).max(1)).collect();
    // The first model furthest from its ideal, by `gap` (greatest first).
    let furthest = |counts: &[u32], gap: &dyn Fn(usize, u32) -> Option<f64>| {
        let mut best: Option<(usize, f64)> = None;
        for (i, c) in counts.iter().enumerate() {
            if let Some(d) = gap(i, *c)
                && best.is_none_or(|(_, b)| d > b)
            {
                best = Some((i, d));
            }
        }
        best.map(|(i, _)| i)
    };
    while counts.iter().sum::<u32>() > groups {
        let Some(i) = furthest(&counts, &|i, c| (c > 1).then(|| f64::from(c) - ideal[i])) else {
            break;
        };
        counts[i] -= 1;
    }
    while counts.iter().sum::<u32>() < groups {
        let Some(i) = furthest(&counts, &|i, c| Some(ideal[i] - f64::from(c))) else {
            break;
        };
        counts[i] += 1;
    }
    counts
}

/// The two-tenant scenario (`WorkloadKind::TwoTenants`): the light tenant
/// alone for a warm-up (not counted) and [`TwoTenants::alone`], then both
/// tenants for [`TwoTenants::together`], the heavy one at
/// [`TwoTenants::HEAVY`] × the light one's rate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct TwoTenants {
    pub warmup: Duration,
    pub alone: Duration,
    pub together: Duration,
}

impl TwoTenants {
    /// The heavy tenant's rate ÷ the light one's.
    pub(crate) const HEAVY: f64 = 10.0;
    /// The tenants' names (`x-kinference-tenant`).
    pub(crate) const LIGHT: &'static str = "light";
    pub(crate) const HEAVY_NAME: &'static str = "heavy";
    /// Label prefixes: the light tenant while alone (after the warm-up),
    /// with the heavy one, and the heavy one.
    pub(crate) const LIGHT_ALONE: &'static str = "light-alone-";
    pub(crate) const LIGHT_WITH: &'static str = "light-with-";
    pub(crate) const HEAVY_LABEL: &'static str = "heavy-";

    /// The plan at `rate`, the two tenants' total while together: the
    /// light tenant at `rate ÷ 11`, the heavy one at `10 × rate ÷ 11`. The
    /// plan's measured window is the together phase.
    pub(crate) fn plan(self, w: &Workload, scale: Scale, rate: f64, seed: u64) -> Plan {
        let Workload::NoReuse {
            prompt_tokens,
            output_tokens,
        } = *w
        else {
            unreachable!("two tenants send distinct prompts")
        };
        let (n, out) = (scale.tokens(prompt_tokens), scale.tokens(output_tokens));
        let light_rate = rate / (1.0 + Self::HEAVY);
        let start_together = self.warmup + self.alone;
        let end = start_together + self.together;
        let mut times: Vec<(Duration, bool)> = arrival_times(light_rate, end, seed)
            .into_iter()
            .map(|t| (t, false))
            .collect();
        times.extend(
            arrival_times(light_rate * Self::HEAVY, self.together, seed ^ 0x4EA7)
                .into_iter()
                .map(|t| (start_together + t, true)),
        );
        times.sort();
        let arrivals = times
            .into_iter()
            .enumerate()
            .map(|(index, (at, heavy))| {
                let (tenant, label) = if heavy {
                    (Self::HEAVY_NAME, Self::HEAVY_LABEL)
                } else if at >= start_together {
                    (Self::LIGHT, Self::LIGHT_WITH)
                } else if at >= self.warmup {
                    (Self::LIGHT, Self::LIGHT_ALONE)
                } else {
                    (Self::LIGHT, "light-warmup-")
                };
                Arrival {
                    index,
                    at,
                    body: Body::Completion {
                        prompt: words(key(7, seed, index as u64), n),
                        max_tokens: out,
                    },
                    label: format!("{label}n{index}"),
                    tenant: Some(tenant),
                    model: None,
                }
            })
            .collect();
        Plan {
            arrivals,
            warmup: start_together,
            measure: self.together,
            conversations: 0,
        }
    }
}
