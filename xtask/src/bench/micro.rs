//! `cargo xtask bench micro`: the criterion benches of the core crates, and
//! a summary of medians against the goals their issues state.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::SystemTime;

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// One benchmark of interest and its goal.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Goal {
    /// Criterion id, `group/function`.
    pub id: &'static str,
    pub what: &'static str,
    pub target: Target,
    /// A peer's figure for the same thing, when one was measured here.
    pub peer: Option<&'static str>,
}

/// A goal on a median.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Target {
    /// Median time at most this many ns.
    AtMostNs(f64),
    /// At least this many elements per second, `elements` per iteration.
    AtLeastPerS { per_s: f64, elements: f64 },
    /// No goal: reported for context.
    None,
}

/// The goals of issues 3 (kvindex), 4 (scoring), 5 (tokenize), 7 (router).
pub(crate) const GOALS: &[Goal] = &[
    Goal {
        id: "find_matches_512/full",
        what: "kvindex: 512-block lookup, full match (issue 3)",
        target: Target::AtMostNs(500.0),
        peer: Some("Dynamo 0.84 µs"),
    },
    Goal {
        id: "find_matches_512/half",
        what: "kvindex: 512-block lookup, half match (issue 3)",
        target: Target::AtMostNs(500.0),
        peer: Some("Dynamo 0.45 µs"),
    },
    Goal {
        id: "find_matches_512/none",
        what: "kvindex: 512-block lookup, no match",
        target: Target::None,
        peer: None,
    },
    Goal {
        id: "apply/decode_store_remove_32_blocks",
        what: "kvindex: decode + apply from vLLM msgpack, 32 blocks stored and removed (issue 3)",
        target: Target::AtLeastPerS {
            per_s: 5e6,
            elements: 32.0,
        },
        peer: None,
    },
    Goal {
        id: "keys/block_keys_8192_tokens",
        what: "kvindex: block keys of an 8,192-token prompt",
        target: Target::None,
        peer: None,
    },
    Goal {
        id: "pick_256/kinference",
        what: "scoring: score + pick among 256 candidates (issue 4)",
        target: Target::AtMostNs(2_000.0),
        peer: None,
    },
    Goal {
        id: "pick_256/least-inflight",
        what: "scoring: least-inflight among 256 (baseline)",
        target: Target::None,
        peer: None,
    },
    Goal {
        id: "chat_8k/warm_new_turn",
        what: "tokenize: 10-turn 8K chat, history cached, new turn (issue 5)",
        target: Target::AtMostNs(150_000.0),
        peer: None,
    },
    Goal {
        id: "chat_8k/warm_resent",
        what: "tokenize: 10-turn 8K chat re-sent, warm (issue 5)",
        target: Target::AtMostNs(150_000.0),
        peer: None,
    },
    Goal {
        id: "chat_8k/cold_all_caches",
        what: "tokenize: 10-turn 8K chat, every cache cold (issue 5)",
        target: Target::AtMostNs(5_000_000.0),
        peer: None,
    },
    Goal {
        id: "completion_1k/cold_cache_off",
        what: "tokenize: 1K-token completion prompt, cold",
        target: Target::None,
        peer: None,
    },
];

/// The router's decision-path goal (issue 7), for every function of its
/// `decision` bench.
pub(crate) const DECISION_GOAL_NS: f64 = 200_000.0;

/// The goal of one function of the router's `decision` bench: issue 14's
/// for a warm 10-turn 8K chat (<= 20 µs) and a cold 5K-token chat (<= 1 ms
/// of CPU), issue 7's for the others.
pub(crate) fn decision_goal(id: &str) -> (&'static str, f64) {
    match id {
        "decision/chat_8k_warm/total" => (
            "router: prepare + decide, warm 10-turn 8K chat (issue 14)",
            20_000.0,
        ),
        "decision/chat_5k_cold/total" => (
            "router: prepare + decide, cold 5K-token chat of random vocabulary (issue 14)",
            1_000_000.0,
        ),
        "decision/chat_5k_cold_prose/total" => (
            "router: prepare + decide, cold 5K-token chat of prose (issue 14)",
            1_000_000.0,
        ),
        "decision/chat_5k_cold_code/total" => (
            "router: prepare + decide, cold 5K-token chat of source code (issue 14)",
            1_000_000.0,
        ),
        _ => (
            "router: tokenize + keys + lookup + score (issue 7)",
            DECISION_GOAL_NS,
        ),
    }
}

/// One criterion result.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Estimate {
    pub id: String,
    pub median_ns: f64,
    pub lower_ns: f64,
    pub upper_ns: f64,
}

/// Reads every `new/estimates.json` under `criterion_dir` written after
/// `since` (all when `None`).
pub(crate) fn read_estimates(
    criterion_dir: &Path,
    since: Option<SystemTime>,
) -> Result<Vec<Estimate>> {
    let mut out = Vec::new();
    let mut stack = vec![criterion_dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            if path.is_dir() {
                if path.file_name().is_some_and(|n| n == "report") {
                    continue;
                }
                stack.push(path);
                continue;
            }
            if path.file_name().is_none_or(|n| n != "estimates.json")
                || path
                    .parent()
                    .and_then(Path::file_name)
                    .is_none_or(|n| n != "new")
            {
                continue;
            }
            if let Some(since) = since {
                let modified = e.metadata().and_then(|m| m.modified()).ok();
                if modified.is_none_or(|m| m < since) {
                    continue;
                }
            }
            if let Some(est) = parse_estimate(&path)? {
                out.push(est);
            }
        }
    }
    out.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(out)
}

/// One `new/estimates.json` with its sibling `benchmark.json` (for the id).
fn parse_estimate(path: &Path) -> Result<Option<Estimate>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let median = &v["median"];
    let (Some(point), Some(lower), Some(upper)) = (
        median["point_estimate"].as_f64(),
        median["confidence_interval"]["lower_bound"].as_f64(),
        median["confidence_interval"]["upper_bound"].as_f64(),
    ) else {
        return Ok(None);
    };
    let id = path
        .parent()
        .map(|p| p.join("benchmark.json"))
        .and_then(|b| std::fs::read_to_string(b).ok())
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|b| b["full_id"].as_str().map(str::to_owned))
        .or_else(|| {
            // Fall back to the directories: criterion/<group>/<function>/new.
            let f = path.parent()?.parent()?;
            let g = f.parent()?;
            Some(format!(
                "{}/{}",
                g.file_name()?.to_string_lossy(),
                f.file_name()?.to_string_lossy()
            ))
        })
        .unwrap_or_default();
    Ok(Some(Estimate {
        id,
        median_ns: point,
        lower_ns: lower,
        upper_ns: upper,
    }))
}

/// A time in ns as the most readable unit.
pub(crate) fn human_ns(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.2} µs", ns / 1e3)
    } else {
        format!("{ns:.0} ns")
    }
}

/// The summary table: goals first, then every other estimate.
pub(crate) fn summary(estimates: &[Estimate], decision_ran: bool) -> (String, usize) {
    use std::fmt::Write as _;
    let mut s = String::new();
    let mut missed = 0;
    let _ = writeln!(
        s,
        "{:<40} {:>12} {:>22} {:>16}  what",
        "benchmark", "median", "goal", "verdict"
    );
    let mut shown = Vec::new();
    let mut line = |s: &mut String, id: &str, what: &str, goal: Target, peer: Option<&str>| {
        let Some(e) = estimates.iter().find(|e| e.id == id) else {
            let _ = writeln!(
                s,
                "{id:<40} {:>12} {:>22} {:>16}  {what}",
                "not run", "", ""
            );
            return;
        };
        shown.push(e.id.clone());
        let (goal_text, verdict) = match goal {
            Target::AtMostNs(g) => (
                format!("≤ {}", human_ns(g)),
                if e.median_ns <= g { "met" } else { "MISSED" }.to_owned(),
            ),
            Target::AtLeastPerS { per_s, elements } => {
                let rate = elements / (e.median_ns * 1e-9);
                (
                    format!("≥ {:.0}M/s", per_s / 1e6),
                    format!(
                        "{} {:.1}M/s",
                        if rate >= per_s { "met" } else { "MISSED" },
                        rate / 1e6
                    ),
                )
            }
            Target::None => (String::new(), String::new()),
        };
        if verdict.starts_with("MISSED") {
            missed += 1;
        }
        let peer = peer.map(|p| format!(" [{p}]")).unwrap_or_default();
        let _ = writeln!(
            s,
            "{id:<40} {:>12} {goal_text:>22} {verdict:>16}  {what}{peer}",
            human_ns(e.median_ns)
        );
    };
    for g in GOALS {
        line(&mut s, g.id, g.what, g.target, g.peer);
    }
    let decisions: Vec<&Estimate> = estimates
        .iter()
        .filter(|e| e.id.starts_with("decision"))
        .collect();
    if decisions.is_empty() {
        let _ = writeln!(
            s,
            "{:<40} {:>12} {:>22} {:>16}  router decision path (issue 7): {}",
            "decision/*",
            "not run",
            format!("≤ {}", human_ns(DECISION_GOAL_NS)),
            "",
            if decision_ran {
                "the bench ran but wrote no estimates"
            } else {
                "kinference-router has no benches/decision.rs yet"
            }
        );
    }
    for e in decisions {
        let (what, goal) = decision_goal(&e.id);
        line(&mut s, &e.id.clone(), what, Target::AtMostNs(goal), None);
    }
    let others: Vec<&Estimate> = estimates
        .iter()
        .filter(|e| !shown.contains(&e.id) && !e.id.starts_with("decision"))
        .collect();
    if !others.is_empty() {
        let _ = writeln!(s, "\nother benchmarks (no goal):");
        for e in others {
            let _ = writeln!(s, "{:<48} {:>12}", e.id, human_ns(e.median_ns));
        }
    }
    (s, missed)
}

/// Options of `bench micro`.
#[derive(Clone, Debug)]
pub(crate) struct MicroOptions {
    /// Criterion's `--quick`.
    pub quick: bool,
    /// Only summarise existing results.
    pub no_run: bool,
}

pub(crate) fn run(root: &Path, opts: &MicroOptions) -> Result<ExitCode> {
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    let criterion_dir = target.join("criterion");
    let started = SystemTime::now();
    let decision = root.join("kinference-router/benches/decision.rs").exists();
    let mut benches: Vec<(&str, &str)> = vec![
        ("kinference-kvindex", "kvindex"),
        ("kinference-scoring", "pick"),
        ("kinference-tokenize", "tokenize"),
    ];
    if decision {
        benches.push(("kinference-router", "decision"));
    } else {
        println!(
            "note: kinference-router/benches/decision.rs does not exist yet; the decision-path row is skipped"
        );
    }
    if !opts.no_run {
        let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        println!("load average before: {}", load.trim());
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        for (package, bench) in &benches {
            println!("== cargo bench -p {package} --bench {bench}");
            let mut cmd = std::process::Command::new(&cargo);
            cmd.current_dir(root)
                .args(["bench", "-p", package, "--bench", bench, "--"]);
            if opts.quick {
                cmd.arg("--quick");
            }
            let status = cmd.status().context("running cargo bench")?;
            if !status.success() {
                bail!("cargo bench -p {package} --bench {bench} failed");
            }
        }
        let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        println!("load average after: {}", load.trim());
    }
    let estimates = read_estimates(&criterion_dir, (!opts.no_run).then_some(started))?;
    if estimates.is_empty() {
        bail!("no criterion estimates under {}", criterion_dir.display());
    }
    let (table, missed) = summary(&estimates, decision);
    println!("\n{table}");
    println!(
        "medians are criterion's point estimates of one run; the index workload v1 (10.24M entries) is a separate harness: cargo bench -p kinference-kvindex --bench index_workload"
    );
    if missed > 0 {
        println!("{missed} goal(s) missed on this run");
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_estimate(dir: &Path, group: &str, function: &str, median: f64) {
        let d = dir.join(group).join(function).join("new");
        std::fs::create_dir_all(&d).expect("mkdir");
        let est = serde_json::json!({
            "mean": {"point_estimate": median * 1.1, "standard_error": 1.0,
                      "confidence_interval": {"confidence_level": 0.95, "lower_bound": median, "upper_bound": median * 1.2}},
            "median": {"point_estimate": median, "standard_error": 1.0,
                        "confidence_interval": {"confidence_level": 0.95, "lower_bound": median * 0.9, "upper_bound": median * 1.1}}
        });
        std::fs::write(d.join("estimates.json"), est.to_string()).expect("write");
        let b = serde_json::json!({"group_id": group, "function_id": function, "full_id": format!("{group}/{function}")});
        std::fs::write(d.join("benchmark.json"), b.to_string()).expect("write");
        // Criterion's previous run sits next to it and must be ignored.
        let base = dir.join(group).join(function).join("base");
        std::fs::create_dir_all(&base).expect("mkdir");
        std::fs::write(base.join("estimates.json"), est.to_string()).expect("write");
    }

    #[test]
    fn estimates_are_read_from_new_and_judged_against_goals() {
        let dir = tempfile::tempdir().expect("tempdir");
        write_estimate(dir.path(), "find_matches_512", "full", 320.0);
        write_estimate(dir.path(), "find_matches_512", "half", 650.0);
        write_estimate(
            dir.path(),
            "apply",
            "decode_store_remove_32_blocks",
            4_000.0,
        );
        write_estimate(dir.path(), "pick_256", "kinference", 2_080.0);
        write_estimate(dir.path(), "misc", "thing", 10.0);
        let e = read_estimates(dir.path(), None).expect("reads");
        assert_eq!(e.len(), 5);
        assert_eq!(e[0].id, "apply/decode_store_remove_32_blocks");
        assert!((e[0].median_ns - 4_000.0).abs() < 1e-9);
        assert!((e[0].lower_ns - 3_600.0).abs() < 1e-9);
        let (table, missed) = summary(&e, false);
        // half (650 ns > 500) and pick (2.08 µs > 2) missed; 32 blocks in
        // 4 µs is 8M/s ≥ 5M/s.
        assert_eq!(missed, 2, "{table}");
        assert!(
            table
                .lines()
                .any(|l| l.starts_with("find_matches_512/full") && l.contains(" met ")),
            "{table}"
        );
        assert!(table.contains("met 8.0M/s"), "{table}");
        assert!(table.contains("has no benches/decision.rs yet"));
        assert!(table.contains("misc/thing"));
        assert!(
            table
                .lines()
                .any(|l| l.starts_with("chat_8k/warm_new_turn") && l.contains("not run"))
        );
    }

    #[test]
    fn decision_benches_get_the_router_goal() {
        let dir = tempfile::tempdir().expect("tempdir");
        write_estimate(dir.path(), "decision", "chat_10_turns_warm", 150_000.0);
        let e = read_estimates(dir.path(), None).expect("reads");
        let (table, missed) = summary(&e, true);
        assert_eq!(missed, 0);
        assert!(
            table
                .lines()
                .any(|l| l.starts_with("decision/chat_10_turns_warm") && l.contains("met")),
            "{table}"
        );
    }

    #[test]
    fn the_decision_bench_is_judged_by_issue_14_where_it_sets_goals() {
        let dir = tempfile::tempdir().expect("tempdir");
        write_estimate(dir.path(), "decision", "chat_8k_warm/total", 30_000.0);
        write_estimate(dir.path(), "decision", "chat_5k_cold/total", 900_000.0);
        write_estimate(
            dir.path(),
            "decision",
            "chat_5k_cold_prose/total",
            1_100_000.0,
        );
        write_estimate(dir.path(), "decision", "chat_5k_cold_code/total", 600_000.0);
        let e = read_estimates(dir.path(), None).expect("reads");
        let (table, missed) = summary(&e, true);
        assert_eq!(missed, 2, "{table}");
        let row = |id: &str| {
            table
                .lines()
                .find(|l| l.starts_with(id))
                .unwrap_or_else(|| panic!("{id} in {table}"))
                .to_owned()
        };
        assert!(row("decision/chat_8k_warm/total").contains("issue 14"));
        assert!(!row("decision/chat_8k_warm/total").contains(" met"));
        assert!(row("decision/chat_5k_cold/total").contains("met"));
        assert!(row("decision/chat_5k_cold_prose/total").contains("prose"));
        assert!(!row("decision/chat_5k_cold_prose/total").contains(" met"));
        assert!(row("decision/chat_5k_cold_code/total").contains("source code"));
        assert!(row("decision/chat_5k_cold_code/total").contains("met"));
    }

    #[test]
    fn human_units() {
        assert_eq!(human_ns(512.0), "512 ns");
        assert_eq!(human_ns(2_080.0), "2.08 µs");
        assert_eq!(human_ns(1_860_000.0), "1.86 ms");
    }
}
