use std::time::Duration;

use super::*;

#[test]
fn percentiles_are_nearest_rank_and_medians_interpolate() {
    let v: Vec<f64> = (1..=10).map(f64::from).collect();
    assert!((percentile(&v, 0.5) - 5.0).abs() < 1e-9);
    assert!((percentile(&v, 0.9) - 9.0).abs() < 1e-9);
    assert!((percentile(&v, 0.99) - 10.0).abs() < 1e-9);
    assert!((percentile(&v, 0.0) - 1.0).abs() < 1e-9);
    assert!(percentile(&[], 0.5).is_nan());
    assert!((median(&[3.0, 1.0, 2.0]) - 2.0).abs() < 1e-9);
    assert!((median(&[4.0, 1.0, 2.0, 3.0]) - 2.5).abs() < 1e-9);
    assert!((median(&[f64::NAN, 5.0]) - 5.0).abs() < 1e-9);
}

pub(super) fn sample(index: usize, ttft_ms: u64, ok: bool) -> Sample {
    Sample {
        index,
        measured: index >= 2,
        ttft: Some(Duration::from_millis(ttft_ms)),
        latency: Duration::from_millis(ttft_ms + 90),
        chunks: 10,
        decode: Duration::from_millis(90),
        ok,
        engine: Some(format!("e{}", index % 2)),
        body_hash: index as u64,
        finished_at: Duration::from_millis(1000 + index as u64 * 100),
        ..Sample::default()
    }
}

pub(super) fn row(policy: &str, repeat: u32, ttft: f64) -> Row {
    let samples: Vec<Sample> = (0..12).map(|i| sample(i, 100 + i as u64, true)).collect();
    let mut r = summarize(
        &samples,
        Window {
            hit_rate: 0.5,
            router_cpu_s: Some(0.001),
        },
        10.0,
        ("shared-prefix", 4.0, 0.5, policy, repeat),
    );
    r.ttft_p90_ms = ttft;
    r
}

#[test]
fn turns_kept_counts_measured_follow_ups_whose_engine_and_previous_are_known() {
    let turn = |index: usize, label: &str, engine: Option<&str>, measured: bool| Sample {
        label: label.to_owned(),
        engine: engine.map(str::to_owned),
        measured,
        ..sample(index, 100, true)
    };
    let samples = [
        // c1: t0 (warm-up) and t1 on e0, t2 on e1: one kept, one moved.
        turn(0, "c1t0", Some("e0"), false),
        turn(1, "c1t1", Some("e0"), true),
        turn(2, "c1t2", Some("e1"), true),
        // c2: its first turn is not a follow-up; t1's engine unknown, so
        // t2 has no known previous engine and neither counts.
        turn(3, "c2t0", Some("e1"), true),
        turn(4, "c2t1", None, true),
        turn(5, "c2t2", Some("e1"), true),
        // Not conversations.
        turn(6, "g1p2", Some("e0"), true),
        turn(7, "ctx", Some("e0"), true),
    ];
    assert!((turns_kept(&samples) - 0.5).abs() < 1e-12);
    let r = Row {
        turns_kept: turns_kept(&samples),
        ..row("kinference", 0, 100.0)
    };
    let md = turns_kept_table(std::slice::from_ref(&r));
    assert!(
        md.contains("| shared-prefix | 4.00 | kinference | 50.0 % |"),
        "{md}"
    );
    // Nothing to say without conversations: no section.
    assert!(turns_kept(&samples[6..]).is_nan());
    assert_eq!(turns_kept_table(&[row("kinference", 0, 100.0)]), "");
}

#[test]
fn learnt_step_costs_are_read_from_the_router_and_listed_per_router() {
    let body = br#"{"endpoints": [
        {"endpoint": "a:1", "calibration": null},
        {"endpoint": "b:1", "calibration": {"steps": {"overhead_ms": 5.1,
          "decode_ms": 0.7, "prefill_ms_per_token": 0.88, "samples": 181,
          "spread": 0.06, "prefill_sd": 0.05, "in_use": true}}}]}"#;
    let c = StepCosts::of_endpoints(body).expect("the second endpoint's fit");
    assert_eq!((c.samples, c.in_use), (181, true));
    assert!((c.prefill_ms_per_token - 0.88).abs() < 1e-9);
    assert_eq!(StepCosts::of_endpoints(b"garbage"), None);
    assert_eq!(StepCosts::of_endpoints(br#"{"endpoints": []}"#), None);

    let mut r = row("kinference-installed", 0, 100.0);
    assert_eq!(step_costs(std::slice::from_ref(&r)), "");
    r.step_costs = vec![c.clone(), StepCosts { in_use: false, ..c }];
    let md = step_costs(&[r]);
    assert!(md.contains("| 5.10 | 0.70 | 0.880 | 181 | yes |"), "{md}");
    assert!(md.contains("| kinference-installed | 0 | 1 | 5.10"), "{md}");
    assert!(md.contains("| no |"), "{md}");
}

#[test]
fn lora_figures_split_measured_base_and_adapter_requests() {
    // Index < 2: warm-up, not counted (and far slower, to show it).
    let mut samples: Vec<Sample> = (0..22)
        .map(|i| {
            let warm = if i < 2 { 5_000 } else { 0 };
            let mut s = if i % 2 == 0 {
                sample(i, warm + 100 + i as u64, true)
            } else {
                sample(i, warm + 1_000 + i as u64, true)
            };
            s.label = if i % 2 == 0 {
                format!("base-g{i}p0")
            } else {
                format!("lora-{}-g{i}p0", i % 8 + 1)
            };
            s
        })
        .collect();
    samples[21].ok = false;
    let l = LoraFigures::of(&samples);
    assert_eq!((l.base.requests, l.base.ok), (10, 10));
    assert_eq!((l.adapters.requests, l.adapters.ok), (10, 9));
    // Base: 102, 104, …, 120 ms; adapters 1,003 … 1,019 ms (1,021 failed).
    assert!((l.base.ttft_p90_ms - 118.0).abs() < 1e-9, "{l:?}");
    assert!((l.adapters.ttft_p90_ms - 1_019.0).abs() < 1e-9, "{l:?}");
    assert!((l.ratio() - 1_019.0 / 118.0).abs() < 1e-9);
    let mut r = row("kinference", 0, 1.0);
    r.workload = "lora".into();
    r.lora = Some(l.clone());
    let m = medians(&[r.clone(), r.clone()]);
    let ml = m[0].lora.as_ref().expect("the median keeps the split");
    assert_eq!((ml.base.requests, ml.adapters.ok), (10, 9));
    assert!((ml.ratio() - l.ratio()).abs() < 1e-9, "{ml:?}");
    assert!(table(&[r.clone()]).contains("adapters p50 1011 p90 1019 ms (9/10 ok)"));
    let back: Row =
        serde_json::from_str(&serde_json::to_string(&r).expect("json")).expect("parses back");
    let bl = back.lora.expect("the split is written and read back");
    assert_eq!((bl.base.requests, bl.adapters.ok), (10, 9));
    assert!((bl.ratio() - l.ratio()).abs() < 1e-9, "{bl:?}");
    assert!(row("kinference", 0, 1.0).lora.is_none());
}

#[test]
fn tenant_shares_read_their_own_labels_and_count_refusals() {
    let mut samples = Vec::new();
    for i in 0..10 {
        let mut s = sample(i, 100 + 10 * i as u64, true);
        s.label = format!("light-alone-n{i}");
        samples.push(s);
    }
    for i in 10..20 {
        let mut s = sample(i, 300 + 10 * i as u64, true);
        s.label = format!("light-with-n{i}");
        samples.push(s);
    }
    for i in 20..30 {
        // A 429: no first token, not ok.
        let mut s = sample(i, 0, false);
        s.ttft = None;
        s.label = format!("heavy-n{i}");
        samples.push(s);
    }
    let alone = Share::of(&samples, "light-alone-");
    assert_eq!((alone.requests, alone.ok, alone.refused), (10, 10, 0));
    assert!((alone.ttft_p90_ms - 180.0).abs() < 1e-9);
    let with = Share::of(&samples, "light-with-");
    assert!((with.ttft_p90_ms - 480.0).abs() < 1e-9);
    let heavy = Share::of(&samples, "heavy-");
    assert_eq!((heavy.requests, heavy.ok, heavy.refused), (10, 0, 10));
    assert!(heavy.ttft_p90_ms.is_nan());
    let t = TenantFigures {
        light_alone: alone,
        light_with_heavy: with,
        heavy,
    };
    assert!((t.ratio() - 480.0 / 180.0).abs() < 1e-9);
    let mut r = row("kinference-admission", 0, 1.0);
    r.workload = "two-tenants".into();
    r.tenants = Some(t);
    assert!(goals(&[r.clone()]).contains("2.67 × (480 vs 180 ms)"));
    assert!(table(&[r]).contains(
        "light tenant TTFT p90 alone 180 ms, with the heavy one 480 ms (2.67×, 10/10 ok)"
    ));
}

#[test]
fn summaries_count_the_window_only() {
    let samples: Vec<Sample> = (0..12).map(|i| sample(i, 100 + i as u64, i != 5)).collect();
    let r = summarize(
        &samples,
        Window {
            hit_rate: 0.25,
            router_cpu_s: Some(0.002),
        },
        10.0,
        ("w", 2.0, 1.0, "p", 0),
    );
    assert_eq!(r.requests, 10);
    assert_eq!(r.ok, 9);
    // Window TTFTs 102..=111 ms: p50 106, p90 110.
    assert!((r.ttft_p50_ms - 106.0).abs() < 1e-9);
    assert!((r.ttft_p90_ms - 110.0).abs() < 1e-9);
    assert!((r.itl_p50_ms - 10.0).abs() < 1e-9);
    assert!((r.router_cpu_us_per_req - 200.0).abs() < 1e-9);
    assert!((r.imbalance - 1.0).abs() < 1e-9);
    assert!((r.req_per_s - 0.9).abs() < 1e-9);
    // The same bodies give the same fingerprint; another body changes it.
    let mut other = samples.clone();
    assert_eq!(
        summarize(&other, Window::default(), 10.0, ("w", 2.0, 1.0, "q", 0)).fingerprint,
        r.fingerprint
    );
    other[3].body_hash = 99;
    assert_ne!(
        summarize(&other, Window::default(), 10.0, ("w", 2.0, 1.0, "q", 0)).fingerprint,
        r.fingerprint
    );
}

#[test]
fn csv_and_json_have_one_record_per_row_and_parse_back() {
    let mut rows = vec![row("kinference", 0, 200.0), row("greedy-truth", 0, 100.0)];
    rows[1].router_cpu_us_per_req = f64::NAN;
    let c = csv(&rows);
    let lines: Vec<&str> = c.lines().collect();
    assert_eq!(lines.len(), 3);
    let columns = lines[0].split(',').count();
    assert_eq!(columns, 24);
    assert!(lines[1..].iter().all(|l| l.split(',').count() == columns));
    assert!(lines[1].starts_with("shared-prefix,4.000,0.500,kinference,0,"));
    let json = serde_json::to_string(&rows).expect("serialises");
    let back: Vec<Row> = serde_json::from_str(&json).expect("parses");
    assert_eq!(back.len(), 2);
    assert_eq!(back[0].policy, "kinference");
    assert!((back[1].ttft_p90_ms - 100.0).abs() < 1e-9);
    // NaN (no router for the greedy reference) goes out as null and comes back.
    assert!(json.contains("\"router_cpu_us_per_req\":null"));
    assert!(back[1].router_cpu_us_per_req.is_nan());
}

#[test]
fn medians_group_repeats_and_the_table_divides_by_the_floor() {
    let mut rows = vec![
        row("kinference", 0, 200.0),
        row("kinference", 1, 300.0),
        row("kinference", 2, 250.0),
        row("greedy-truth", 0, 100.0),
    ];
    for r in &mut rows {
        (r.floor_p50_ms, r.floor_p90_ms, r.floor_p99_ms) = (53.0, 50.0, 111.0);
    }
    let m = medians(&rows);
    assert_eq!(m.len(), 2);
    assert_eq!(m[0].repeat, 3);
    assert!((m[0].ttft_p90_ms - 250.0).abs() < 1e-9);
    let t = table(&rows);
    let ours = t
        .lines()
        .find(|l| l.starts_with("kinference"))
        .expect("a row");
    // p50 106 ÷ 53 = 2.0, p90 250 ÷ 50 = 5.0, p99 111 ÷ 111 = 1.0.
    assert!(ours.contains("  2.0   5.0   1.0 "), "{ours}");
    assert!(t.contains("physical floor p50 53 p90 50 p99 111 ms"), "{t}");
    let md = markdown(&rows);
    assert!(
        md.contains(
            "| **kinference** | 10 | 10 | 10 | 50.0 % | 106 | 250 | 111 | 2.0 / 5.0 / 1.0 | "
        ),
        "{md}"
    );
}
