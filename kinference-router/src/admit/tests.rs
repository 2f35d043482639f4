use super::*;

fn h(pairs: &[(&HeaderName, &str)]) -> HeaderMap {
    let mut m = HeaderMap::new();
    for (k, v) in pairs {
        m.insert((*k).clone(), v.parse().unwrap());
    }
    m
}

#[test]
fn class_and_target_come_from_headers_and_bad_values_are_ignored() {
    let c = Class::from_headers(&h(&[(&TENANT_HEADER, " acme "), (&PRIORITY_HEADER, "7")]));
    assert_eq!(c.tenant, "acme");
    assert_eq!(c.priority, 7);
    let c = Class::from_headers(&h(&[(&PRIORITY_HEADER, "high")]));
    assert_eq!((c.tenant.as_str(), c.priority), ("", 0));
    let c = Class::from_headers(&h(&[(&PRIORITY_HEADER, "-100000")]));
    assert_eq!(c.priority, -MAX_PRIORITY);
    assert_eq!(
        target(&h(&[(&TTFT_TARGET_HEADER, "1500")])),
        Some(Duration::from_millis(1500))
    );
    for bad in ["0", "-5", "NaN", "soon"] {
        assert_eq!(target(&h(&[(&TTFT_TARGET_HEADER, bad)])), None, "{bad}");
    }
    assert_eq!(target(&HeaderMap::new()), None);
}

fn tenant(
    name: &str,
    weight: Option<u32>,
    models: &[&str],
) -> kinference_api::v1alpha1::TenantSpec {
    kinference_api::v1alpha1::TenantSpec {
        name: name.into(),
        weight,
        models: models.iter().map(|m| (*m).to_owned()).collect(),
    }
}

#[test]
fn the_key_names_the_tenant_then_the_model_then_the_header() {
    use crate::auth::KeyClass;
    let tenants = Tenants::from_spec(&[tenant("batch", Some(1), &["qwen-batch"])]);
    assert_eq!(tenants.for_model("qwen-batch"), Some("batch"));
    assert_eq!(tenants.for_model("qwen"), None);
    let claims = h(&[(&TENANT_HEADER, "gold"), (&PRIORITY_HEADER, "50")]);
    let acme = KeyClass {
        tenant: Some("acme".into()),
        priority: Some(2),
    };
    // The key's tenant wins over the model's and the header's; its
    // priority is the highest the header may ask for.
    let c = Class::resolve(Some(&acme), tenants.for_model("qwen-batch"), &claims);
    assert_eq!((c.tenant.as_str(), c.priority), ("acme", 2));
    let lower = h(&[(&PRIORITY_HEADER, "-3")]);
    assert_eq!(Class::resolve(Some(&acme), None, &lower).priority, -3);
    assert_eq!(
        Class::resolve(Some(&acme), None, &HeaderMap::new()).priority,
        2
    );
    // A key naming no tenant: the model's, then the header's.
    let plain = KeyClass::default();
    let c = Class::resolve(Some(&plain), tenants.for_model("qwen-batch"), &claims);
    assert_eq!((c.tenant.as_str(), c.priority), ("batch", 50));
    let c = Class::resolve(Some(&plain), tenants.for_model("qwen"), &claims);
    assert_eq!(c.tenant, "gold");
    // No key (the router checks none): as before, headers alone.
    assert_eq!(
        Class::resolve(None, None, &claims),
        Class::from_headers(&claims)
    );
    let long = "t".repeat(100);
    let c = Class::resolve(None, None, &h(&[(&TENANT_HEADER, &long)]));
    assert_eq!(c.tenant.len(), MAX_TENANT_CHARS);
}

#[test]
fn a_tenant_of_weight_three_is_released_three_times_the_tokens() {
    let q = Queue::new(Tenants::from_spec(&[
        tenant("gold", Some(3), &[]),
        tenant("free", None, &[]),
    ]));
    assert_eq!(q.tenants().weight("gold"), 3);
    assert_eq!(q.tenants().weight("free"), 1);
    assert_eq!(q.tenants().weight("unlisted"), 1);
    let t0 = Instant::now();
    let class = |tenant: &str| Class {
        tenant: tenant.into(),
        priority: 0,
    };
    // Both flood the queue with 1000-token requests, the free tenant
    // first.
    let mut who = HashMap::new();
    for _ in 0..12 {
        who.insert(q.join(&class("free"), 1000, t0, 100).unwrap().0, "free");
    }
    for _ in 0..12 {
        who.insert(q.join(&class("gold"), 1000, t0, 100).unwrap().0, "gold");
    }
    let mut order = Vec::new();
    for _ in 0..16 {
        let head = Queue::head(&q.state.lock().entries, t0)
            .map(|e| e.id)
            .unwrap();
        q.leave(head, t0, true);
        q.served(who[&head], 1000, t0);
        order.push(who[&head]);
    }
    // Virtual starts per token of weight 1 (costs rounded up, so that a
    // weight never buys more than its share): free 0, 1000, 2000, …;
    // gold 0, 333.334, 666.668, 1000.002, …: three gold requests per
    // free one.
    assert_eq!(
        order,
        [
            "free", "gold", "gold", "gold", "free", "gold", "gold", "gold", "free", "gold", "gold",
            "gold", "free", "gold", "gold", "gold",
        ]
    );
}

impl Queue {
    /// A request of `tenant` that waits: recorded, then whether it is
    /// ahead of its share.
    fn arrive_waiting(&self, tenant: &str, tokens: u64, now: Instant) -> bool {
        self.arrive(tenant, tokens, now, false);
        self.ahead_of_share(tenant, now)
    }
}

#[test]
fn a_tenant_is_ahead_of_its_share_only_while_one_far_behind_it_is_active() {
    let q = Queue::default();
    let t0 = Instant::now();
    let ms = Duration::from_millis;
    // Alone, the heavy tenant is never ahead, however much it asks.
    for i in 0..20 {
        assert!(!q.arrive_waiting("heavy", 5_000, t0 + ms(100 * i)));
    }
    // A light tenant appears: it is not ahead; the heavy one, asking
    // ten times its tokens, is.
    let t1 = t0 + ms(2_000);
    assert!(!q.arrive_waiting("light", 5_000, t1));
    assert!(q.arrive_waiting("heavy", 5_000, t1 + ms(100)));
    assert!(!q.arrive_waiting("light", 5_000, t1 + ms(1_000)));
    // A flood that starts beside a steady tenant is seen within a
    // second: the steady one asked for 5,000 tokens a second for 10 s.
    let q = Queue::default();
    for i in 0..10 {
        assert!(!q.arrive_waiting("steady", 5_000, t0 + ms(1_000 * i)));
    }
    let flood = t0 + ms(10_000);
    let ahead: Vec<bool> = (0..10)
        .map(|i| q.arrive_waiting("flood", 5_000, flood + ms(100 * i)))
        .collect();
    assert!(ahead[9], "{ahead:?}");
    assert!(!q.arrive_waiting("steady", 5_000, flood + ms(1_000)));
    // Near equal shares: neither is.
    let q = Queue::default();
    for i in 0..10 {
        assert!(!q.arrive_waiting("a", 5_000, t0 + ms(100 * i)));
        assert!(!q.arrive_waiting("b", 5_000, t0 + ms(100 * i + 50)));
    }
    // Weights count: a tenant of weight 10 asking ten times the tokens
    // is at its share.
    let q = Queue::new(Tenants::from_spec(&[tenant("big", Some(10), &[])]));
    assert!(!q.arrive_waiting("small", 5_000, t0));
    assert!(!q.arrive_waiting("big", 50_000, t0));
    // Tenant names from headers cannot grow the map without bound.
    let q = Queue::default();
    for i in 0..(MAX_TENANTS + 100) {
        q.arrive_waiting(&format!("t{i}"), 1, t0);
    }
    let later = t0 + SHARE_WINDOW + ms(1);
    q.arrive_waiting("last", 1, later);
    assert!(
        q.state.lock().tenants.len() <= MAX_TENANTS,
        "forgotten when idle"
    );
    // A tenant gone quiet for the window no longer holds the other back.
    let q = Queue::default();
    assert!(!q.arrive_waiting("light", 1_000, t0));
    assert!(q.arrive_waiting("heavy", 50_000, t0));
    let later = t0 + SHARE_WINDOW + ms(1);
    assert!(!q.arrive_waiting("heavy", 50_000, later));
}

#[test]
fn release_order_is_priority_then_tenant_share_then_arrival_and_waiting_ages() {
    let q = Queue::default();
    let t0 = Instant::now();
    let class = |tenant: &str, priority| Class {
        tenant: tenant.into(),
        priority,
    };
    // Two tenants queue 1000-token requests: the heavy one first, four
    // of them; the light one's single request goes second, not fifth.
    let heavy: Vec<_> = (0..4)
        .map(|_| q.join(&class("heavy", 0), 1000, t0, 10).unwrap().0)
        .collect();
    let (light, _) = q.join(&class("light", 0), 1000, t0, 10).unwrap();
    let (urgent, _) = q.join(&class("heavy", 1), 1000, t0, 10).unwrap();
    assert_eq!(q.depth(), 6);
    assert!(q.is_head(urgent, t0), "strict priority first");
    q.leave(urgent, t0, true);
    q.served("heavy", 1000, t0);
    assert!(q.is_head(heavy[0], t0), "then the lowest virtual start");
    q.leave(heavy[0], t0, true);
    q.served("heavy", 1000, t0);
    assert!(q.is_head(light, t0), "the light tenant's share comes next");
    q.leave(light, t0, true);
    assert!(q.is_head(heavy[1], t0));
    // Aging: a priority-0 request that has waited two AGING steps goes
    // before a fresh priority-1 one.
    let later = t0 + AGING * 2;
    let (fresh, _) = q.join(&class("light", 1), 1000, later, 10).unwrap();
    assert!(q.is_head(heavy[1], later), "the old request aged past it");
    assert!(q.is_head(fresh, t0 + AGING / 2), "not yet at half a step");
    for id in [heavy[1], heavy[2], heavy[3], fresh] {
        q.leave(id, later, false);
    }
    assert_eq!(q.depth(), 0);
    // Within one priority, waiting long earns nothing over another
    // tenant's share: a light tenant's fresh request still goes before
    // a heavy tenant's requests that have waited 5 s.
    let q2 = Queue::default();
    q2.served("heavy", 5000, t0);
    let old: Vec<_> = (0..3)
        .map(|_| q2.join(&class("heavy", 0), 1000, t0, 10).unwrap().0)
        .collect();
    let at = t0 + Duration::from_secs(5);
    let (newer, _) = q2.join(&class("light", 0), 1000, at, 10).unwrap();
    assert!(q2.is_head(newer, at));
    q2.leave(newer, at, true);
    assert!(q2.is_head(old[0], at));
    // Bounded.
    let ids: Vec<_> = (0..3)
        .map(|_| q.join(&class("", 0), 1, t0, 3).unwrap().0)
        .collect();
    assert!(
        q.join(&class("", 0), 1, t0, 3).is_none(),
        "the queue is full"
    );
    for id in ids {
        q.leave(id, t0, false);
    }
    // A tenant idle for long starts at the virtual time, not far
    // behind it with a burst of credit.
    q.served("idle", 0, t0);
    let (x, _) = q.join(&class("idle", 0), 1, t0, 10).unwrap();
    let (y, _) = q.join(&class("heavy", 0), 1, t0, 10).unwrap();
    let s = q.state.lock();
    let start = |id| s.entries.iter().find(|e| e.id == id).unwrap().start;
    assert!(start(x) >= s.vtime && start(y) >= s.vtime);
}
