//! What a run measures beside the requests' figures: the routers' CPU,
//! the machine's load, a late replica's hit rate against its peers', the
//! bytes between replicas, a replica killed mid-run, the slow engine's
//! share.

use std::time::Duration;

use super::{Proc, drive, http_port, load};

/// `utime + stime` of a process, seconds.
pub(crate) fn cpu_seconds(pid: u32, ticks_per_s: f64) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_cpu_ticks(&stat).map(|t| t as f64 / ticks_per_s)
}

/// `utime + stime` (clock ticks) from a `/proc/PID/stat` line.
pub(crate) fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    // The command name may contain spaces: fields start after the last ')'.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest[0] is field 3 (state); utime is field 14, stime 15.
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some(utime + stime)
}

pub(crate) fn clock_ticks() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .trim()
                .parse::<f64>()
                .ok()
        })
        .unwrap_or(100.0)
}

pub(super) fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// How long after a late replica is ready its hit rate is compared with
/// its peers' (issue 17: "within 10 s").
pub(crate) const JOIN_WINDOW: Duration = Duration::from_secs(10);

/// A late replica's requests sent within a window after it was ready,
/// beside its peers' over the same interval.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct JoinWindow {
    /// Prefix-cache hit rate (cached ÷ prompt tokens, from each response's
    /// usage) of its requests, and of its peers'.
    pub hit_rate: f64,
    pub peers_hit_rate: f64,
    /// Its requests with usage.
    pub requests: usize,
    /// TTFT p90 (ms) of its answered requests, and of its peers'.
    pub ttft_p90_ms: f64,
    pub peers_ttft_p90_ms: f64,
}

/// [`JoinWindow`] of replica `index`, over the requests sent within
/// `window` of `from` (NaN where there are none).
pub(crate) fn join_window(
    samples: &[drive::Sample],
    index: usize,
    from: Duration,
    window: Duration,
) -> JoinWindow {
    let mut sums = [(0u64, 0u64, 0usize); 2];
    let mut ttfts: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for s in samples {
        let Some(r) = s.replica else {
            continue;
        };
        if s.sent_at < from || s.sent_at >= from + window {
            continue;
        }
        let side = usize::from(r != index);
        if let (Some(p), Some(c)) = (s.prompt_tokens, s.cached_tokens) {
            let x = &mut sums[side];
            x.0 += c;
            x.1 += p;
            x.2 += 1;
        }
        if let Some(t) = s.ttft.filter(|_| s.ok) {
            ttfts[side].push(t.as_secs_f64() * 1e3);
        }
    }
    let rate = |(c, p, _): (u64, u64, usize)| {
        if p == 0 {
            f64::NAN
        } else {
            c as f64 / p as f64
        }
    };
    let p90 = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        crate::bench::report::percentile(v, 0.9)
    };
    JoinWindow {
        hit_rate: rate(sums[0]),
        peers_hit_rate: rate(sums[1]),
        requests: sums[0].2,
        ttft_p90_ms: p90(&mut ttfts[0]),
        peers_ttft_p90_ms: p90(&mut ttfts[1]),
    }
}

/// Bytes every reachable replica received from its peers: load polls and
/// their answers, snapshots and their requests
/// (`kinference_router_peer_bytes_total{direction="received"}`).
pub(super) async fn peer_bytes(admins: &[String]) -> (f64, f64) {
    let mut out = (0.0, 0.0);
    for a in admins {
        let Ok((200, body)) = load::get(&format!("http://{a}/metrics")).await else {
            continue;
        };
        let text = String::from_utf8_lossy(&body);
        for s in kinference_api::engine::prometheus::samples(&text) {
            if s.name != "kinference_router_peer_bytes_total"
                || s.label("direction") != Some("received")
            {
                continue;
            }
            match s.label("kind") {
                Some("load") => out.0 += s.value,
                Some("snapshot") => out.1 += s.value,
                _ => {}
            }
        }
    }
    out
}

/// Kills router `victim` (SIGKILL, as an OOM kill does: its port refuses
/// connections at once) after `at`, then watches the survivors'
/// `kinference_router_peers_reporting`: the time until every survivor
/// stopped counting the killed replica's load (each then hears only from
/// the other survivors), or `None` if that took over 10 s. Gives the
/// process back, to be reaped with the others.
pub(super) async fn kill_and_watch(
    mut victim: Proc,
    survivors: Vec<String>,
    at: Duration,
) -> (Proc, Option<Duration>) {
    tokio::time::sleep(at).await;
    let killed = tokio::time::Instant::now();
    if victim.kill().is_err() {
        return (victim, None);
    }
    let others = (survivors.len().saturating_sub(1)) as f64;
    while killed.elapsed() < Duration::from_secs(10) {
        let mut all = true;
        for a in &survivors {
            let reporting = match load::get(&format!("http://{a}/metrics")).await {
                Ok((200, body)) => peers_reporting(&String::from_utf8_lossy(&body)),
                _ => None,
            };
            all &= reporting.is_some_and(|r| r <= others);
        }
        if all {
            return (victim, Some(killed.elapsed()));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    (victim, None)
}

/// `kinference_router_peers_reporting` from a metrics page.
pub(super) fn peers_reporting(metrics: &str) -> Option<f64> {
    kinference_api::engine::prometheus::samples(metrics)
        .find(|s| s.name == "kinference_router_peers_reporting")
        .map(|s| s.value)
}

/// The share of the measured requests the slowest engine served, when one
/// engine is slower than the others and the router names engines
/// (`x-kinference-endpoint`); NaN otherwise.
pub(super) fn slow_share(samples: &[drive::Sample], slowdowns: &[f64], port_base: u16) -> f64 {
    let Some(i) = slowest(slowdowns) else {
        return f64::NAN;
    };
    let slow = format!("127.0.0.1:{}", http_port(port_base, i));
    let named: Vec<&drive::Sample> = samples
        .iter()
        .filter(|x| x.measured && x.engine.is_some())
        .collect();
    if named.is_empty() {
        return f64::NAN;
    }
    named
        .iter()
        .filter(|x| x.engine.as_deref() == Some(slow.as_str()))
        .count() as f64
        / named.len() as f64
}

/// The one engine slower than all others, if there is one.
fn slowest(slowdowns: &[f64]) -> Option<usize> {
    let (i, s) = slowdowns
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))?;
    (*s > 1.0 && slowdowns.iter().filter(|x| (*x - s).abs() < 1e-9).count() == 1).then_some(i)
}

/// The slowest engine's share of the requests the engines received between
/// two readings of their counters ([`load::EngineCounters::received`], in
/// the engines' order), when one engine is slower than the others; NaN
/// otherwise or when a reading is missing.
pub(super) fn received_share(before: &[f64], after: &[f64], slowdowns: &[f64]) -> f64 {
    let Some(i) = slowest(slowdowns) else {
        return f64::NAN;
    };
    if before.len() != slowdowns.len() || after.len() != slowdowns.len() {
        return f64::NAN;
    }
    let got: Vec<f64> = after.iter().zip(before).map(|(a, b)| a - b).collect();
    let total: f64 = got.iter().sum();
    if total.is_nan() || total <= 0.0 {
        return f64::NAN;
    }
    got[i] / total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slow_engines_share_comes_from_what_each_engine_received() {
        let slowdowns = [1.0, 1.0, 10.0, 1.0];
        // Warm-up counts before the window; the window's 10, 10, 5, 15.
        let before = [3.0, 4.0, 2.0, 1.0];
        let after = [13.0, 14.0, 7.0, 16.0];
        let share = received_share(&before, &after, &slowdowns);
        assert!((share - 5.0 / 40.0).abs() < 1e-12, "{share}");
        // No single slowest engine, an engine unread, nothing received.
        assert!(received_share(&before, &after, &[1.0; 4]).is_nan());
        assert!(received_share(&before, &after, &[1.0, 3.0, 3.0, 1.0]).is_nan());
        let unread = [13.0, f64::NAN, 7.0, 16.0];
        assert!(received_share(&before, &unread, &slowdowns).is_nan());
        assert!(received_share(&before, &before, &slowdowns).is_nan());
        assert!(received_share(&before[..3], &after, &slowdowns).is_nan());
    }

    #[test]
    fn a_late_replica_is_compared_with_its_peers_over_the_same_window() {
        let s = |replica: usize, at: u64, prompt: u64, cached: u64| drive::Sample {
            replica: Some(replica),
            sent_at: Duration::from_secs(at),
            prompt_tokens: Some(prompt),
            cached_tokens: Some(cached),
            ..drive::Sample::default()
        };
        let samples = [
            // Before it was ready, after its window: not counted.
            s(0, 4, 100, 0),
            s(2, 21, 100, 0),
            // Its requests, and its peers', in [5 s, 15 s).
            s(2, 5, 100, 50),
            s(2, 14, 300, 250),
            s(0, 6, 100, 90),
            s(1, 10, 100, 70),
            // No usage (an error): not counted.
            drive::Sample {
                replica: Some(2),
                sent_at: Duration::from_secs(7),
                ..drive::Sample::default()
            },
        ];
        let w = join_window(&samples, 2, Duration::from_secs(5), JOIN_WINDOW);
        assert!((w.hit_rate - 0.75).abs() < 1e-12, "{w:?}");
        assert!((w.peers_hit_rate - 0.8).abs() < 1e-12, "{w:?}");
        assert_eq!(w.requests, 2);
        let w = join_window(&samples, 2, Duration::from_secs(30), JOIN_WINDOW);
        assert!(w.hit_rate.is_nan() && w.peers_hit_rate.is_nan() && w.requests == 0);

        // TTFTs: its own and its peers' in the window, answered ones only.
        let t = |replica: usize, at: u64, ms: u64, ok: bool| drive::Sample {
            replica: Some(replica),
            sent_at: Duration::from_secs(at),
            ttft: Some(Duration::from_millis(ms)),
            ok,
            ..drive::Sample::default()
        };
        let mut timed: Vec<drive::Sample> = (0..10).map(|i| t(2, 6, 100 + 10 * i, true)).collect();
        timed.extend([
            t(2, 4, 9_000, true),
            t(2, 7, 9_000, false),
            t(0, 8, 50, true),
        ]);
        let w = join_window(&timed, 2, Duration::from_secs(5), JOIN_WINDOW);
        assert_eq!((w.ttft_p90_ms, w.peers_ttft_p90_ms), (180.0, 50.0));
        let w = join_window(&timed, 2, Duration::from_secs(30), JOIN_WINDOW);
        assert!(w.ttft_p90_ms.is_nan() && w.peers_ttft_p90_ms.is_nan());
    }

    #[test]
    fn proc_stat_cpu_fields() {
        let stat = "1234 (kinference-ro ter) S 1 1234 1234 0 -1 4194560 2040 0 0 0 250 37 0 0 20 0 9 0 5263 1220608000 4521 18446744073709551615";
        assert_eq!(parse_cpu_ticks(stat), Some(287));
        assert_eq!(parse_cpu_ticks("garbage"), None);
        let own = cpu_seconds(std::process::id(), 100.0);
        assert!(own.is_some_and(|s| s >= 0.0));
    }

    #[test]
    fn peers_reporting_reads_the_gauge_and_nothing_like_it() {
        let page = "# HELP kinference_router_peers Other replicas\n# TYPE kinference_router_peers gauge\nkinference_router_peers 2\n# TYPE kinference_router_peers_reporting gauge\nkinference_router_peers_reporting 1\n";
        assert_eq!(peers_reporting(page), Some(1.0));
        assert_eq!(peers_reporting("kinference_router_peers 2\n"), None);
    }
}
