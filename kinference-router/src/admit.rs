//! Admission, between [`crate::prepare`] and the first [`crate::decide`]:
//! past the knee, a request whose best predicted time to first token is over
//! its bound waits here, in a bounded queue per worker set, instead of on an
//! engine; it is released, in order, as capacity frees (a first token, a
//! response's end), or answered 429 with `Retry-After` in OpenAI's error
//! shape when the queue is full or its wait runs out. No engine sees a
//! rejected request.
//!
//! The bound is the worker set's `RoutingProfile.spec.admission`
//! (`maxPredictedTtftMillis`, `maxQueue`, `maxWaitMillis`) and, per request,
//! the header [`TTFT_TARGET_HEADER`]: a request with a target waits at most
//! that long, and only while its remaining budget is below the prediction.
//! Without either, nothing waits: the gate is a branch on the decision
//! already taken (no lock, no clock read beyond the one the request path
//! already does).
//!
//! Release order is [`Class`]: strict priority (higher first, a class
//! aged one step per [`AGING`] its oldest request waited, so that nothing
//! starves), then between
//! tenants weighted fair sharing by uncached prefill tokens (the tenant
//! that has been sent the fewest tokens per weight goes first; weights from
//! `spec.admission.tenants`, [`Tenants`]), then arrival. A waiting
//! request of a tenant far ahead of another active one is also released
//! only while an engine is left with nothing prefilling ([`SHARE_WINDOW`]).
//! Only the queue's
//! head re-decides, on every freed capacity and at least every
//! [`HEAD_TICK`]; the others sleep until they become head or their deadline
//! passes.
//!
//! A request's tenant is, in this order: the one its client's API key
//! names (the operator's word: a client cannot claim another tenant by
//! header), the one its model or alias names in the profile, the
//! [`TENANT_HEADER`], else the default tenant ([`Class::resolve`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use http::HeaderMap;
use http::header::HeaderName;
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::decide::{Decision, Now};
use crate::metrics::{RejectionLabels, WorkerSetLabels};
use crate::openai::ApiError;
use crate::state::Shared;

/// Request header: the request's time-to-first-token target, milliseconds.
pub const TTFT_TARGET_HEADER: HeaderName = HeaderName::from_static("x-kinference-ttft-target-ms");
/// Request header: the tenant the request is accounted to.
pub const TENANT_HEADER: HeaderName = HeaderName::from_static("x-kinference-tenant");
/// Request header: the request's priority (an integer, higher first; 0 by
/// default).
pub const PRIORITY_HEADER: HeaderName = HeaderName::from_static("x-kinference-priority");

/// How often the queue's head re-decides when no capacity event woke it
/// (scraped figures, evidence and ejections change predictions too).
pub const HEAD_TICK: Duration = Duration::from_millis(25);

/// A priority class gains one step per this much wait of its oldest
/// request: a priority-0 class whose oldest request has waited 2 s goes
/// before a fresh priority-1 one, so that no class starves. (The class
/// ages as a whole, so aging never reorders tenants within it.)
pub const AGING: Duration = Duration::from_secs(2);

/// Priorities are clamped to ±this.
pub const MAX_PRIORITY: i64 = 100;

/// Tenant names are cut to this many characters.
pub const MAX_TENANT_CHARS: usize = 64;

/// Tenants a queue remembers before it forgets idle ones.
const MAX_TENANTS: usize = 4096;

/// A tenant counts as active for this long after its last request. While
/// an active tenant asks for less than a quarter of the tokens per weight of
/// another (its requests' uncached prefill tokens as they arrive, served
/// or not, decaying with a half-life of [`RATE_HALF_LIFE`]), a waiting
/// request of the one ahead is released only while an engine other than
/// the one it goes to has nothing prefilling (`Queue::arrive`): past the
/// knee, one engine is kept free for the tenant behind, whose requests
/// then start their prefill at once instead of sharing an engine's batch
/// with the flood. Below the knee nothing waits and the rule does not
/// apply.
pub const SHARE_WINDOW: Duration = Duration::from_secs(10);

/// The half-life of the tokens tenants ask for, as compared for
/// [`SHARE_WINDOW`]: short, so that a tenant that starts a flood is seen
/// ahead of a steady one within a second.
pub const RATE_HALF_LIFE: Duration = Duration::from_secs(2);

/// Virtual-time units per uncached prefill token of a tenant of weight 1
/// (a tenant of weight w advances by this ÷ w per token, rounded up).
const WEIGHT_SCALE: u64 = 1000;

/// The profile's tenants: weights (unlisted: 1) and which models or aliases
/// name which tenant.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tenants {
    weights: HashMap<String, u32>,
    by_model: HashMap<String, String>,
}

impl Tenants {
    /// From the profile's `spec.admission.tenants`.
    pub fn from_spec(spec: &[kinference_api::v1alpha1::TenantSpec]) -> Self {
        use kinference_api::v1alpha1::TenantSpec;
        let mut t = Self::default();
        for x in spec {
            let name: String = x.name.chars().take(MAX_TENANT_CHARS).collect();
            let w = x
                .weight
                .unwrap_or(TenantSpec::DEFAULT_WEIGHT)
                .clamp(1, 1000);
            if w != TenantSpec::DEFAULT_WEIGHT {
                t.weights.insert(name.clone(), w);
            }
            for m in &x.models {
                t.by_model.entry(m.clone()).or_insert_with(|| name.clone());
            }
        }
        t
    }

    /// `tenant`'s weight.
    pub fn weight(&self, tenant: &str) -> u32 {
        self.weights.get(tenant).copied().unwrap_or(1).max(1)
    }

    /// The tenant whose requests ask for `model` (a name or alias), if one
    /// is listed for it.
    pub fn for_model(&self, model: &str) -> Option<&str> {
        self.by_model.get(model).map(String::as_str)
    }

    /// `tokens` of `tenant`'s in virtual-time units (rounded up: a weight
    /// never buys more than its share).
    fn virtual_cost(&self, tenant: &str, tokens: u64) -> u64 {
        tokens
            .saturating_mul(WEIGHT_SCALE)
            .div_ceil(u64::from(self.weight(tenant)))
    }
}

/// A worker set's admission settings (its profile's `spec.admission`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limits {
    /// Hold a request while the best predicted TTFT exceeds this, ms.
    pub max_predicted_ttft_ms: f64,
    /// Requests held at most.
    pub max_queue: usize,
    /// Longest a request is held.
    pub max_wait: Duration,
}

impl Limits {
    /// From the profile's `spec.admission`.
    pub fn from_spec(a: &kinference_api::v1alpha1::Admission) -> Self {
        use kinference_api::v1alpha1::Admission;
        Self {
            max_predicted_ttft_ms: a.max_predicted_ttft_millis,
            max_queue: a.max_queue.unwrap_or(Admission::DEFAULT_MAX_QUEUE) as usize,
            max_wait: Duration::from_millis(
                a.max_wait_millis
                    .unwrap_or(Admission::DEFAULT_MAX_WAIT_MILLIS),
            ),
        }
    }
}

/// Who a request is, for the release order: its tenant and priority.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Class {
    /// The tenant (empty: the default tenant).
    pub tenant: String,
    /// The priority, higher first.
    pub priority: i64,
}

impl Class {
    /// From the request's headers alone.
    pub fn from_headers(h: &HeaderMap) -> Self {
        Self::resolve(None, None, h)
    }

    /// The request's class from what the operator set and what the client
    /// sent, the operator's word first:
    ///
    /// - **tenant**: the one `key` names (the client's API key: a client
    ///   holding it cannot be accounted to another tenant), else the one
    ///   the requested model or alias names (`model_tenant`, the profile's
    ///   `admission.tenants[].models`), else [`TENANT_HEADER`], else the
    ///   default tenant;
    /// - **priority**: [`PRIORITY_HEADER`], but never above the key's
    ///   `priority` (which is also the default); without one, the header
    ///   or 0. Clamped to ±[`MAX_PRIORITY`].
    pub fn resolve(
        key: Option<&crate::auth::KeyClass>,
        model_tenant: Option<&str>,
        h: &HeaderMap,
    ) -> Self {
        let text = |name: &HeaderName| h.get(name).and_then(|v| v.to_str().ok()).map(str::trim);
        let tenant = key
            .and_then(|k| k.tenant.as_deref())
            .or(model_tenant)
            .or_else(|| text(&TENANT_HEADER))
            .map(|t| t.chars().take(MAX_TENANT_CHARS).collect())
            .unwrap_or_default();
        let asked = text(&PRIORITY_HEADER).and_then(|p| p.parse::<i64>().ok());
        let priority = match (asked, key.and_then(|k| k.priority)) {
            (Some(a), Some(k)) => a.min(k),
            (None, Some(k)) => k,
            (Some(a), None) => a,
            (None, None) => 0,
        };
        Self {
            tenant,
            priority: priority.clamp(-MAX_PRIORITY, MAX_PRIORITY),
        }
    }
}

/// The request's TTFT target from [`TTFT_TARGET_HEADER`], if valid.
pub fn target(h: &HeaderMap) -> Option<Duration> {
    let ms: f64 = h
        .get(&TTFT_TARGET_HEADER)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    (ms.is_finite() && ms > 0.0).then(|| Duration::from_secs_f64(ms.min(3_600_000.0) / 1e3))
}

/// Requests waiting in any queue of this process: capacity events notify
/// only while there are some.
static QUEUED: AtomicUsize = AtomicUsize::new(0);
static FREED: Notify = Notify::const_new();

/// Capacity freed at some endpoint (a first token, a response's end): wakes
/// the queues' heads. Free when nothing waits.
pub fn capacity_freed() {
    if QUEUED.load(Ordering::Relaxed) > 0 {
        FREED.notify_waiters();
    }
}

struct Entry {
    id: u64,
    priority: i64,
    joined: Instant,
    tenant: String,
    /// Its cost, uncached prefill tokens (as first decided) in virtual-time
    /// units (÷ its tenant's weight).
    cost: u64,
    /// Its virtual start: the tenant's tokens sent plus those of its
    /// requests queued ahead of this one. Lower goes first.
    start: u64,
    wake: Arc<Notify>,
}

impl Entry {
    /// Release order at `now`, given when the oldest request of its
    /// priority joined: aged priority (higher first; the class ages as a
    /// whole, by its oldest request, so that aging lifts a starving class
    /// without reordering the fair share within one), then virtual start
    /// (tenant share), then arrival.
    fn key(&self, now: Instant, class_oldest: Instant) -> (i64, u64, u64) {
        let aged = i64::try_from(
            now.saturating_duration_since(class_oldest).as_millis() / AGING.as_millis().max(1),
        )
        .unwrap_or(i64::MAX);
        (-(self.priority.saturating_add(aged)), self.start, self.id)
    }
}

#[derive(Default)]
struct Tenant {
    /// Uncached prefill tokens sent, in virtual-time units.
    sent: u64,
    /// Of its requests waiting, in virtual-time units.
    queued: u64,
    waiting: usize,
    /// Tokens asked for in virtual-time units, decaying with a half-life
    /// of [`RATE_HALF_LIFE`], as of `at`.
    recent: f64,
    /// Its last request's arrival.
    at: Option<Instant>,
}

impl Tenant {
    /// Its decayed recent tokens at `now`.
    fn recent(&self, now: Instant) -> f64 {
        self.at.map_or(0.0, |at| {
            let age = now.saturating_duration_since(at).as_secs_f64();
            self.recent * 0.5f64.powf(age / RATE_HALF_LIFE.as_secs_f64())
        })
    }

    fn active(&self, now: Instant) -> bool {
        self.at
            .is_some_and(|t| now.saturating_duration_since(t) < SHARE_WINDOW)
    }
}

#[derive(Default)]
struct State {
    entries: Vec<Entry>,
    tenants: HashMap<String, Tenant>,
    /// The virtual start of the last request released: a tenant that had
    /// nothing waiting starts here, so past idleness earns no burst of
    /// credit and past heaviness no lasting penalty (start-time fair
    /// queueing).
    vtime: u64,
    /// The tenants map's size at which [`State::bound_tenants`] next scans
    /// it (0: [`MAX_TENANTS`]), and when it last did.
    next_scan: usize,
    last_scan: Option<Instant>,
}

impl State {
    /// The tenant named `tenant`, created if new (without copying the name
    /// of a known one).
    fn tenant(&mut self, tenant: &str) -> &mut Tenant {
        if !self.tenants.contains_key(tenant) {
            self.tenants.insert(tenant.to_owned(), Tenant::default());
        }
        self.tenants
            .get_mut(tenant)
            .unwrap_or_else(|| unreachable!())
    }

    /// Keeps the tenants map bounded (tenant names come from clients'
    /// headers): past [`MAX_TENANTS`], tenants with nothing waiting, not
    /// active and not ahead of the virtual time are forgotten; they would
    /// start at the virtual time and count as inactive anyway. When most
    /// are still active, the next scan waits until the map has doubled or
    /// [`SHARE_WINDOW`] has passed (tenants only go inactive with time), so
    /// requests do not each pay for a scan that frees nothing.
    fn bound_tenants(&mut self, now: Instant) {
        let len = self.tenants.len();
        if len <= MAX_TENANTS {
            return;
        }
        let due = len > self.next_scan
            || self
                .last_scan
                .is_none_or(|t| now.saturating_duration_since(t) >= SHARE_WINDOW);
        if due {
            let vtime = self.vtime;
            self.tenants
                .retain(|_, t| t.waiting > 0 || t.sent > vtime || t.active(now));
            self.next_scan = 2 * self.tenants.len();
            self.last_scan = Some(now);
        }
    }
}

/// One worker set's admission queue.
#[derive(Default)]
pub struct Queue {
    depth: AtomicUsize,
    next_id: AtomicU64,
    tenants: Tenants,
    state: Mutex<State>,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("depth", &self.depth.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Queue {
    /// A queue sharing between `tenants`.
    pub fn new(tenants: Tenants) -> Self {
        Self {
            tenants,
            ..Self::default()
        }
    }

    /// The tenants' weights and models.
    pub fn tenants(&self) -> &Tenants {
        &self.tenants
    }

    /// Requests waiting.
    pub fn depth(&self) -> usize {
        self.depth.load(Ordering::Relaxed)
    }

    /// Records `tokens` uncached prefill tokens sent for `tenant` at `now`
    /// (while admission applies to the worker set), for fair sharing.
    pub fn served(&self, tenant: &str, tokens: u64, now: Instant) {
        let tokens = self.tenants.virtual_cost(tenant, tokens);
        let mut s = self.state.lock();
        Self::send(&mut s, tenant, tokens);
        s.bound_tenants(now);
    }

    fn send(s: &mut State, tenant: &str, tokens: u64) {
        let vtime = s.vtime;
        let t = s.tenant(tenant);
        if t.waiting == 0 {
            t.sent = t.sent.max(vtime);
        }
        t.sent = t.sent.saturating_add(tokens);
    }

    /// Records a request of `tenant` asking for `tokens` uncached prefill
    /// tokens at `now`, and, when it is sent at once (`sent`), those tokens
    /// as served: one lock for the request that does not wait.
    fn arrive(&self, tenant: &str, tokens: u64, now: Instant, sent: bool) {
        let tokens = self.tenants.virtual_cost(tenant, tokens);
        let mut s = self.state.lock();
        let t = s.tenant(tenant);
        t.recent = t.recent(now) + tokens as f64;
        t.at = Some(now);
        if sent {
            Self::send(&mut s, tenant, tokens);
        }
        s.bound_tenants(now);
    }

    /// Whether `tenant` is ahead of its share at `now`: another tenant
    /// active within [`SHARE_WINDOW`] asks for less than a quarter of its
    /// recent tokens per weight. Tenants near equal shares are not, so that
    /// sharing costs no throughput between them. A scan of the tenants:
    /// asked only for a request that waits.
    fn ahead_of_share(&self, tenant: &str, now: Instant) -> bool {
        let s = self.state.lock();
        let Some(mine) = s.tenants.get(tenant).map(|t| t.recent(now)) else {
            return false;
        };
        s.tenants
            .iter()
            .any(|(name, t)| name != tenant && t.active(now) && 4.0 * t.recent(now) < mine)
    }

    fn join(
        &self,
        class: &Class,
        cost: u64,
        now: Instant,
        max: usize,
    ) -> Option<(u64, Arc<Notify>)> {
        let cost = self.tenants.virtual_cost(&class.tenant, cost);
        let mut s = self.state.lock();
        if s.entries.len() >= max {
            return None;
        }
        let vtime = s.vtime;
        let t = s.tenant(&class.tenant);
        if t.waiting == 0 {
            t.sent = t.sent.max(vtime);
        }
        let start = t.sent.saturating_add(t.queued);
        t.queued = t.queued.saturating_add(cost);
        t.waiting += 1;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let wake = Arc::new(Notify::new());
        s.entries.push(Entry {
            id,
            priority: class.priority,
            joined: now,
            tenant: class.tenant.clone(),
            cost,
            start,
            wake: wake.clone(),
        });
        self.depth.store(s.entries.len(), Ordering::Relaxed);
        QUEUED.fetch_add(1, Ordering::Relaxed);
        Some((id, wake))
    }

    fn head(e: &[Entry], now: Instant) -> Option<&Entry> {
        // When each priority's oldest request joined (a handful of
        // priorities in practice).
        let mut oldest: Vec<(i64, Instant)> = Vec::new();
        for x in e {
            match oldest.iter_mut().find(|(p, _)| *p == x.priority) {
                Some((_, t)) => *t = (*t).min(x.joined),
                None => oldest.push((x.priority, x.joined)),
            }
        }
        let class_oldest = |p: i64| {
            oldest
                .iter()
                .find(|(q, _)| *q == p)
                .map_or(now, |(_, t)| *t)
        };
        e.iter()
            .min_by_key(|x| x.key(now, class_oldest(x.priority)))
    }

    fn is_head(&self, id: u64, now: Instant) -> bool {
        Self::head(&self.state.lock().entries, now).is_some_and(|h| h.id == id)
    }

    /// Leaves the queue (`released`: to be sent, which moves the virtual
    /// time) and wakes the next head.
    fn leave(&self, id: u64, now: Instant, released: bool) {
        let mut s = self.state.lock();
        if let Some(i) = s.entries.iter().position(|x| x.id == id) {
            let e = s.entries.swap_remove(i);
            QUEUED.fetch_sub(1, Ordering::Relaxed);
            if released {
                s.vtime = s.vtime.max(e.start);
            }
            if let Some(t) = s.tenants.get_mut(&e.tenant) {
                t.queued = t.queued.saturating_sub(e.cost);
                t.waiting = t.waiting.saturating_sub(1);
            }
        }
        self.depth.store(s.entries.len(), Ordering::Relaxed);
        if let Some(h) = Self::head(&s.entries, now) {
            h.wake.notify_one();
        }
    }
}

/// A request's place in a queue: leaves it when dropped (sent, rejected,
/// or the client gone), waking the next head, and records the wait.
struct Held<'a> {
    q: &'a Queue,
    id: u64,
    released: bool,
    start: Instant,
    metrics: &'a crate::metrics::Metrics,
    labels: WorkerSetLabels,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let now = Instant::now();
        self.q.leave(self.id, now, self.released);
        self.metrics
            .queue_depth
            .get_or_create(&self.labels)
            .set(self.q.depth() as i64);
        self.metrics
            .queue_wait
            .get_or_create(&self.labels)
            .observe(now.saturating_duration_since(self.start).as_secs_f64());
    }
}

/// The fastest candidate's predicted TTFT as the decision reports it: the
/// chosen endpoint's, or, when kinference chose a later one (to stay warm,
/// or the best of those meeting the request's target), the fastest's.
/// (Baseline policies report the chosen endpoint's uncalibrated
/// prediction.)
pub fn fastest_ms(d: &Decision) -> f64 {
    use kinference_scoring::Reason;
    let p = d.choice.prediction.ttft_ms;
    match d.choice.reason {
        Reason::StayedWarm { later_ms, .. } | Reason::MetTarget { later_ms, .. } => {
            (p - later_ms).max(0.0)
        }
        _ => p,
    }
}

/// One request's admission: its limits (profile and target) and class.
#[derive(Debug)]
pub struct Gate {
    runtime: Arc<crate::runtime::WsRuntime>,
    worker_set: String,
    /// Its index in the request's view.
    ws: usize,
    limits: Option<Limits>,
    /// When its TTFT target runs out.
    target: Option<Instant>,
    class: Class,
    arrived: Instant,
}

impl Gate {
    /// The gate for a request whose first decision is `d`, or `None` when
    /// no bound applies (admission off and no target): then nothing waits.
    pub fn new(
        view: &crate::view::View,
        prepared: &crate::prepare::Prepared,
        d: &Decision,
        arrived: Instant,
    ) -> Option<Self> {
        let route = &prepared.routes[d.route];
        let ws = &view.worker_sets[route.target.worker_set];
        let limits = ws.runtime.admission;
        let target = prepared.ttft_deadline;
        if limits.is_none() && target.is_none() {
            return None;
        }
        let class = Class::resolve(
            prepared.key_class.as_ref(),
            ws.runtime.queue.tenants().for_model(&prepared.requested),
            &prepared.headers,
        );
        Some(Self {
            runtime: ws.runtime.clone(),
            worker_set: ws.route.name.clone(),
            ws: route.target.worker_set,
            limits,
            target,
            class,
            arrived,
        })
    }

    /// The class the request is accounted to.
    pub fn class(&self) -> &Class {
        &self.class
    }

    /// The bound on the best predicted TTFT at `now`, ms: the profile's,
    /// and the request's remaining target.
    fn bound(&self, now: Instant) -> f64 {
        let mut b = self
            .limits
            .map_or(f64::INFINITY, |l| l.max_predicted_ttft_ms);
        if let Some(t) = self.target {
            let left = t.saturating_duration_since(now);
            b = b.min(left.as_secs_f64() * 1e3);
        }
        b
    }

    /// When waiting ends with a 429.
    fn deadline(&self) -> Instant {
        match (self.limits.map(|l| self.arrived + l.max_wait), self.target) {
            (Some(w), Some(t)) => w.min(t),
            (Some(w), None) => w,
            (None, Some(t)) => t,
            (None, None) => self.arrived,
        }
    }

    /// Whether `d` leaves an engine free for the tenants behind: another
    /// healthy endpoint of the worker set than `d`'s has no request before
    /// its first token (this replica's or, with shared load, its peers').
    /// A worker set with one healthy endpoint keeps none free.
    fn leaves_one_free(&self, view: &crate::view::View, d: &Decision, now: Instant) -> bool {
        let Some(ws) = view.worker_sets.get(self.ws) else {
            return true;
        };
        let mut healthy = 0usize;
        let mut free = false;
        for e in ws.endpoints.iter().filter(|e| e.healthy(now)) {
            healthy += 1;
            free |= e.id != d.endpoint.id && e.load.snapshot().prefilling == 0;
        }
        healthy < 2 || free
    }

    /// Whether a waiting request may be sent on `d` at `now`: its fastest
    /// prediction within the bound and, for a tenant ahead of its share at
    /// the request's arrival (`ahead`), an engine left free.
    fn may_release(
        &self,
        view: &crate::view::View,
        d: &Decision,
        now: Instant,
        ahead: bool,
    ) -> bool {
        fastest_ms(d) <= self.bound(now) && (!ahead || self.leaves_one_free(view, d, now))
    }

    fn max_queue(&self) -> usize {
        self.limits.map_or(
            kinference_api::v1alpha1::Admission::DEFAULT_MAX_QUEUE as usize,
            |l| l.max_queue,
        )
    }

    fn labels(&self) -> WorkerSetLabels {
        WorkerSetLabels {
            worker_set: self.worker_set.clone(),
        }
    }

    fn reject(&self, shared: &Shared, reason: &'static str, fastest: f64, bound: f64) -> ApiError {
        shared
            .metrics
            .rejections
            .get_or_create(&RejectionLabels { reason })
            .inc();
        let over = if bound.is_finite() {
            (fastest - bound).max(0.0)
        } else {
            0.0
        };
        let retry = (over / 1e3).ceil().clamp(1.0, 3600.0) as u64;
        let message = match reason {
            "queue_full" => format!(
                "The router's admission queue for this model is full ({} requests wait): the engines are past capacity. Retry after {retry} s.",
                self.max_queue()
            ),
            _ => format!(
                "No engine can serve this request within its deadline (predicted time to first token {fastest:.0} ms). Retry after {retry} s."
            ),
        };
        ApiError::too_many_requests(message, reason, retry)
    }

    /// Sends `first` on when its fastest prediction is within the bound and
    /// nothing waits ahead; else holds the request, re-deciding (`redecide`,
    /// at the `Now` given) whenever it is the queue's head and capacity
    /// freed, until a decision is within the bound (returned) or the
    /// deadline passes (429).
    ///
    /// # Errors
    /// 429 when the queue is full or the deadline passed; what `redecide`
    /// returns.
    pub async fn hold(
        &self,
        shared: &Shared,
        view: &crate::view::View,
        first: Decision,
        mut redecide: impl FnMut(Now) -> Result<Decision, ApiError>,
    ) -> Result<Decision, ApiError> {
        let q = &self.runtime.queue;
        let tenant = &self.class.tenant;
        let start = Instant::now();
        let fastest = fastest_ms(&first);
        let cost = u64::from(first.choice.uncached_tokens());
        let at_once = fastest <= self.bound(start) && q.depth() == 0;
        q.arrive(tenant, cost, start, at_once);
        if at_once {
            return Ok(first);
        }
        let ahead = q.ahead_of_share(tenant, start);
        drop(first);
        let deadline = self.deadline();
        if start >= deadline {
            return Err(self.reject(shared, "deadline", fastest, self.bound(start)));
        }
        let Some((id, wake)) = q.join(&self.class, cost, start, self.max_queue()) else {
            return Err(self.reject(shared, "queue_full", fastest, self.bound(start)));
        };
        // Leaves the queue however the wait ends, the client going away
        // (this future dropped) included: a request that left must never
        // stay at the head.
        let mut held = Held {
            q,
            id,
            released: false,
            start,
            metrics: &shared.metrics,
            labels: self.labels(),
        };
        held.metrics
            .queue_depth
            .get_or_create(&held.labels)
            .set(q.depth() as i64);
        let mut fastest = fastest;
        loop {
            let now = Instant::now();
            let head = q.is_head(id, now);
            if head {
                let d = match redecide(Now {
                    instant: now,
                    since_start: shared.now(),
                }) {
                    Ok(d) => d,
                    Err(e) => return Err(e),
                };
                fastest = fastest_ms(&d);
                if self.may_release(view, &d, now, ahead) {
                    held.released = true;
                    q.served(tenant, u64::from(d.choice.uncached_tokens()), now);
                    return Ok(d);
                }
            }
            if now >= deadline {
                return Err(self.reject(shared, "deadline", fastest, self.bound(now)));
            }
            let freed = FREED.notified();
            let until = if head {
                deadline.min(now + HEAD_TICK)
            } else {
                deadline
            };
            tokio::select! {
                () = freed, if head => {}
                () = wake.notified() => {}
                () = tokio::time::sleep_until(until) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests;
