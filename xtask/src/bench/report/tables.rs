//! The run's figures as text: the table on stdout, its Markdown, the goals
//! of issues 16 and 18, and the learnt step costs.

use std::fmt::Write as _;

use super::{Row, medians};

/// `(p50, p90, p99) ÷ the physical floor`.
fn floor_ratios(r: &Row) -> (f64, f64, f64) {
    (
        r.ttft_p50_ms / r.floor_p50_ms,
        r.ttft_p90_ms / r.floor_p90_ms,
        r.ttft_p99_ms / r.floor_p99_ms,
    )
}

/// The table (medians over repeats), with TTFT ratios to the physical floor.
pub(crate) fn table(rows: &[Row]) -> String {
    let rows = medians(rows);
    let mut s = String::new();
    let mut last = (String::new(), f64::NAN);
    for r in &rows {
        if r.workload != last.0 || (r.rate - last.1).abs() > 1e-9 {
            let _ = writeln!(
                s,
                "\n{} at {:.2} req/s ({:.2}× knee); physical floor p50 {:.0} p90 {:.0} p99 {:.0} ms\n{:<24} {:>5} {:>5} {:>5} {:>6} {:>9} {:>9} {:>9} {:>17} {:>7} {:>7} {:>8} {:>9} {:>6}",
                r.workload,
                r.rate,
                r.load,
                r.floor_p50_ms,
                r.floor_p90_ms,
                r.floor_p99_ms,
                "policy",
                "reqs",
                "ok",
                "good",
                "hit %",
                "TTFT p50",
                "TTFT p90",
                "TTFT p99",
                "÷ floor 50/90/99",
                "ITL p50",
                "req/s",
                "CPU µs/r",
                "max/mean",
                "slow %"
            );
            last = (r.workload.clone(), r.rate);
        }
        let (f50, f90, f99) = floor_ratios(r);
        let _ = writeln!(
            s,
            "{:<24} {:>5} {:>5} {:>5} {:>6.1} {:>7.0}ms {:>7.0}ms {:>7.0}ms {:>5.1} {:>5.1} {:>5.1} {:>5.1}ms {:>7.2} {:>8.0} {:>9.2} {:>6.1}",
            r.policy,
            r.requests,
            r.ok,
            r.good,
            r.hit_rate * 100.0,
            r.ttft_p50_ms,
            r.ttft_p90_ms,
            r.ttft_p99_ms,
            f50,
            f90,
            f99,
            r.itl_p50_ms,
            r.req_per_s,
            r.router_cpu_us_per_req,
            r.imbalance,
            r.slow_share * 100.0
        );
        if let Some(t) = &r.tenants {
            let _ = writeln!(s, "{:<24} {t}", "");
        }
        if let Some(l) = &r.lora {
            let _ = writeln!(s, "{:<24} {l}", "");
        }
    }
    s
}

/// The real peers' rows.
fn is_peer(policy: &str) -> bool {
    policy.starts_with("smg-") || policy.starts_with("vllm-router-")
}

/// The faithful re-implementations' rows.
fn is_baseline(policy: &str) -> bool {
    matches!(
        policy,
        "llm-d-blend" | "llm-d-default" | "dynamo-cost" | "sglang-cache-aware"
    )
}

/// Issue 18's goals at each workload's knee (load 1.0, medians over
/// repeats), as a Markdown table; empty when no knee row of ours exists.
pub(crate) fn goals(rows: &[Row]) -> String {
    let rows = medians(rows);
    let verdict = |ok: bool| if ok { "met" } else { "**missed**" };
    let mut out = String::new();
    let mut workloads: Vec<&str> = Vec::new();
    for r in &rows {
        if !workloads.contains(&r.workload.as_str()) {
            workloads.push(&r.workload);
        }
    }
    for w in workloads {
        let at: Vec<&Row> = rows
            .iter()
            .filter(|r| r.workload == w && (r.load - 1.0).abs() < 1e-6)
            .collect();
        let Some(ours) = at.iter().find(|r| r.policy == "kinference") else {
            continue;
        };
        if out.is_empty() {
            out.push_str("| workload (at the knee) | goal | measured | |\n|---|---|---|---|\n");
        }
        let mut push = |goal: &str, figure: String, ok: bool| {
            let _ = writeln!(out, "| {w} | {goal} | {figure} | {} |", verdict(ok));
        };
        let best = |f: fn(&str) -> bool| {
            at.iter()
                .filter(|r| f(&r.policy))
                .min_by(|a, b| a.ttft_p90_ms.total_cmp(&b.ttft_p90_ms))
        };
        let predictive = w == "heterogeneous" || w == "agent";
        if let Some(p) = best(is_peer) {
            let r = ours.ttft_p90_ms / p.ttft_p90_ms;
            let (goal, ok) = if predictive {
                ("TTFT p90 ≤ 0.5 × the best real peer's".to_owned(), r <= 0.5)
            } else {
                (
                    "TTFT p90 ≤ 1.05 × the best real peer's".to_owned(),
                    r <= 1.05,
                )
            };
            push(
                &goal,
                format!(
                    "{r:.2} × ({:.0} vs {:.0} ms, {})",
                    ours.ttft_p90_ms, p.ttft_p90_ms, p.policy
                ),
                ok,
            );
        }
        if let Some(b) = best(is_baseline) {
            let r = ours.ttft_p90_ms / b.ttft_p90_ms;
            let (goal, ok) = if predictive {
                (
                    "TTFT p90 ≤ 0.8 × the best faithful baseline's".to_owned(),
                    r <= 0.8,
                )
            } else {
                (
                    "TTFT p90 ≤ 1.05 × the best faithful baseline's".to_owned(),
                    r <= 1.05,
                )
            };
            push(
                &goal,
                format!(
                    "{r:.2} × ({:.0} vs {:.0} ms, {})",
                    ours.ttft_p90_ms, b.ttft_p90_ms, b.policy
                ),
                ok,
            );
        }
        if let Some(worst) = at
            .iter()
            .filter(|r| r.policy != "kinference" && r.policy != "greedy-truth")
            .min_by(|a, b| a.ttft_p99_ms.total_cmp(&b.ttft_p99_ms))
        {
            push(
                "TTFT p99 no worse than any other policy's",
                format!(
                    "{:.0} vs best {:.0} ms ({})",
                    ours.ttft_p99_ms, worst.ttft_p99_ms, worst.policy
                ),
                ours.ttft_p99_ms <= worst.ttft_p99_ms,
            );
        }
        if let Some(i) = at.iter().find(|r| r.policy == "kinference-installed") {
            let r = i.ttft_p90_ms / ours.ttft_p90_ms;
            push(
                "as installed within 1.25 × tuned (TTFT p90)",
                format!(
                    "{r:.2} × ({:.0} vs {:.0} ms)",
                    i.ttft_p90_ms, ours.ttft_p90_ms
                ),
                r <= 1.25,
            );
        }
    }
    out.push_str(&past_the_knee(&rows));
    out
}

/// Issue 16's goals: goodput at 2 × the knee of the overload ladder
/// (admission against round robin and the best other row), and the slow
/// engine's share of the slow burst. Medians over repeats.
pub(crate) fn past_the_knee(rows: &[Row]) -> String {
    let verdict = |ok: bool| if ok { "met" } else { "**missed**" };
    let mut out = String::new();
    let mut push = |w: &str, goal: &str, figure: String, ok: bool| {
        if out.is_empty() {
            out.push_str("\n| workload | goal | measured | |\n|---|---|---|---|\n");
        }
        let _ = writeln!(out, "| {w} | {goal} | {figure} | {} |", verdict(ok));
    };
    let at2: Vec<&Row> = rows
        .iter()
        .filter(|r| r.workload == "overload" && (r.load - 2.0).abs() < 0.05)
        .collect();
    if let Some(ours) = at2.iter().find(|r| r.policy == "kinference-admission") {
        if let Some(rr) = at2.iter().find(|r| r.policy == "round-robin") {
            let x = ours.goodput_per_s / rr.goodput_per_s;
            push(
                "overload (2× knee)",
                "goodput (TTFT ≤ 2 s) ≥ 2 × round robin's",
                format!(
                    "{x:.2} × ({:.2} vs {:.2} req/s)",
                    ours.goodput_per_s, rr.goodput_per_s
                ),
                x >= 2.0,
            );
        }
        if let Some(best) = at2
            .iter()
            .filter(|r| r.policy != "kinference-admission" && r.policy != "greedy-truth")
            .max_by(|a, b| a.goodput_per_s.total_cmp(&b.goodput_per_s))
        {
            let x = ours.goodput_per_s / best.goodput_per_s;
            push(
                "overload (2× knee)",
                "goodput ≥ 1.3 × the best other policy's",
                format!(
                    "{x:.2} × ({:.2} vs {:.2} req/s, {})",
                    ours.goodput_per_s, best.goodput_per_s, best.policy
                ),
                x >= 1.3,
            );
        }
        push(
            "overload (2× knee)",
            "no request waits unboundedly (every one answered or rejected)",
            format!("{} still running at the drain deadline", ours.gave_up),
            ours.gave_up == 0,
        );
    }
    for r in rows.iter().filter(|r| {
        r.workload == "two-tenants"
            && r.policy.starts_with("kinference-admission")
            && r.tenants.is_some()
    }) {
        if let Some(t) = &r.tenants {
            push(
                &format!("two-tenants ({:.1}× knee, {})", r.load, r.policy),
                "the light tenant's TTFT p90 with a heavy one at 10× its rate ≤ 1.5 × alone",
                format!(
                    "{:.2} × ({:.0} vs {:.0} ms)",
                    t.ratio(),
                    t.light_with_heavy.ttft_p90_ms,
                    t.light_alone.ttft_p90_ms
                ),
                t.ratio() <= 1.5,
            );
        }
    }
    for r in rows
        .iter()
        .filter(|r| r.workload == "slow-burst" && r.policy == "kinference")
        // A fleet without a slow engine (`--burst-slowdown 1`) has no share.
        .filter(|r| !r.slow_share.is_nan())
    {
        push(
            "slow-burst",
            "the 10× slower engine gets ≤ 5 % of the burst",
            format!("{:.1} %", r.slow_share * 100.0),
            r.slow_share <= 0.05,
        );
    }
    out
}

/// The same table as Markdown (for docs/benchmarks.md).
pub(crate) fn markdown(rows: &[Row]) -> String {
    let rows = medians(rows);
    let mut s = String::new();
    let mut last = (String::new(), f64::NAN);
    for r in &rows {
        if r.workload != last.0 || (r.rate - last.1).abs() > 1e-9 {
            let _ = writeln!(
                s,
                "\n**{}, {:.2} req/s ({:.2}× knee)**; physical floor TTFT p50 {:.0}, p90 {:.0}, p99 {:.0} ms\n\n| policy | reqs | ok | good (TTFT ≤ 2 s) | hit rate | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | ÷ floor p50 / p90 / p99 | ITL p50 ms | req/s | goodput req/s | router CPU µs/req |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
                r.workload, r.rate, r.load, r.floor_p50_ms, r.floor_p90_ms, r.floor_p99_ms
            );
            last = (r.workload.clone(), r.rate);
        }
        let (f50, f90, f99) = floor_ratios(r);
        let name = if r.policy == "kinference" {
            format!("**{}**", r.policy)
        } else {
            r.policy.clone()
        };
        let cpu = if r.router_cpu_us_per_req.is_nan() {
            "–".to_owned()
        } else {
            format!("{:.0}", r.router_cpu_us_per_req)
        };
        let _ = writeln!(
            s,
            "| {name} | {} | {} | {} | {:.1} % | {:.0} | {:.0} | {:.0} | {f50:.1} / {f90:.1} / {f99:.1} | {:.1} | {:.2} | {:.2} | {cpu} |",
            r.requests,
            r.ok,
            r.good,
            r.hit_rate * 100.0,
            r.ttft_p50_ms,
            r.ttft_p90_ms,
            r.ttft_p99_ms,
            r.itl_p50_ms,
            r.req_per_s,
            r.goodput_per_s
        );
    }
    s
}

/// Where the rows left conversations' histories ([`Row::turns_kept`]),
/// medians over repeats, one line per row that has the figure (empty
/// without any).
pub(crate) fn turns_kept_table(rows: &[Row]) -> String {
    let mut out = String::new();
    for r in medians(rows).iter().filter(|r| !r.turns_kept.is_nan()) {
        if out.is_empty() {
            out.push_str(
                "\n**Turns kept** (measured follow-up turns sent to the engine of the turn before, \
                 for routers that name their engine)\n\n\
                 | workload | req/s | policy | turns kept |\n|---|---:|---|---:|\n",
            );
        }
        let _ = writeln!(
            out,
            "| {} | {:.2} | {} | {:.1} % |",
            r.workload,
            r.rate,
            r.policy,
            r.turns_kept * 100.0
        );
    }
    out
}

/// The kinference rows' learnt step costs, one line per router (empty
/// without any).
pub(crate) fn step_costs(rows: &[Row]) -> String {
    let mut out = String::new();
    for r in rows {
        for (i, c) in r.step_costs.iter().enumerate() {
            if out.is_empty() {
                out.push_str(
                    "\n**Learnt step costs** (each kinference router's at the end of the row)\n\n\
                     | workload | req/s | policy | repeat | router | overhead ms | decode ms/seq | prefill ms/token | streams | in use |\n\
                     |---|---:|---|---:|---:|---:|---:|---:|---:|---|\n",
                );
            }
            let _ = writeln!(
                out,
                "| {} | {:.2} | {} | {} | {i} | {:.2} | {:.2} | {:.3} | {} | {} |",
                r.workload,
                r.rate,
                r.policy,
                r.repeat,
                c.overhead_ms,
                c.decode_ms,
                c.prefill_ms_per_token,
                c.samples,
                if c.in_use { "yes" } else { "no" },
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::tests::row;
    use super::*;

    #[test]
    fn past_the_knee_goals_read_goodput_at_twice_the_knee_and_the_slow_share() {
        let mut rows = vec![
            row("kinference-admission", 0, 1500.0),
            row("round-robin", 0, 20_000.0),
            row("dynamo-cost", 0, 20_000.0),
        ];
        for (r, g) in rows.iter_mut().zip([4.0, 1.0, 2.0]) {
            r.workload = "overload".into();
            r.load = 2.0;
            r.goodput_per_s = g;
        }
        let mut burst = row("kinference", 0, 900.0);
        burst.workload = "slow-burst".into();
        burst.slow_share = 0.079;
        rows.push(burst);
        let g = past_the_knee(&rows);
        assert!(
            g.contains("| overload (2× knee) | goodput (TTFT ≤ 2 s) ≥ 2 × round robin's | 4.00 × (4.00 vs 1.00 req/s) | met |"),
            "{g}"
        );
        assert!(
            g.contains("| goodput ≥ 1.3 × the best other policy's | 2.00 × (4.00 vs 2.00 req/s, dynamo-cost) | met |"),
            "{g}"
        );
        assert!(g.contains("| 7.9 % | **missed** |"), "{g}");
        // The reference fleet without a slow engine has no share to judge.
        let mut reference = row("kinference", 0, 900.0);
        reference.workload = "slow-burst".into();
        let g = past_the_knee(&[reference]);
        assert!(!g.contains("slower engine gets"), "{g}");
    }

    #[test]
    fn goals_are_checked_at_each_knee() {
        let mut rows = vec![
            row("kinference", 0, 120.0),
            row("kinference-installed", 0, 140.0),
            row("smg-cache-aware", 0, 300.0),
            row("dynamo-cost", 0, 110.0),
            row("greedy-truth", 0, 90.0),
        ];
        for r in &mut rows {
            r.load = 1.0;
        }
        rows[0].ttft_p99_ms = 500.0;
        let g = goals(&rows);
        assert!(
            g.contains("| shared-prefix | TTFT p90 ≤ 1.05 × the best real peer's | 0.40 × (120 vs 300 ms, smg-cache-aware) | met |"),
            "{g}"
        );
        assert!(
            g.contains("| shared-prefix | TTFT p90 ≤ 1.05 × the best faithful baseline's | 1.09 × (120 vs 110 ms, dynamo-cost) | **missed** |"),
            "{g}"
        );
        assert!(
            g.contains("| TTFT p99 no worse than any other policy's | 500 vs best 111 ms"),
            "{g}"
        );
        assert!(
            g.contains(
                "| as installed within 1.25 × tuned (TTFT p90) | 1.17 × (140 vs 120 ms) | met |"
            ),
            "{g}"
        );
        // On the two-speed fleet the bar is halving the best peer.
        for r in &mut rows {
            r.workload = "heterogeneous".into();
        }
        assert!(
            goals(&rows)
                .contains("| heterogeneous | TTFT p90 ≤ 0.5 × the best real peer's | 0.40 × ")
        );
        for r in &mut rows {
            r.load = 0.5;
        }
        assert!(goals(&rows).is_empty());
    }
}
