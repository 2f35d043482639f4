//! Which LoRA adapters an engine runs, for requests that name one.
//!
//! vLLM runs at most `--max-loras` distinct adapters in one batch. A request
//! whose adapter would exceed that waits, while requests behind it go
//! ahead, until every running request of some other adapter has finished:
//! on a busy engine, a whole generation. Sending an adapter request where
//! its adapter already runs costs nothing; where a slot is free, a load.
//!
//! Two sources, merged at decision time ([`Adapters::slot`]):
//! - the engine's `vllm:lora_requests_info` (running and waiting adapters,
//!   `max_lora`), scraped with the other metrics and trusted for
//!   `metrics_max_age`; `max_lora` is configuration and is kept after that;
//! - this router's own adapter requests in flight there, counted from send
//!   to the end of the response ([`crate::endpoint::InFlight`]): exact and
//!   immediate, so a burst of a new adapter stays where its first request
//!   went.
//!
//! An engine that never exported the gauge (no adapters, SGLang, other
//! servers) gives [`AdapterSlot::Unknown`]: routing as before.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use kinference_api::engine::AdapterFigures;
use kinference_scoring::AdapterSlot;
use parking_lot::{Mutex, RwLock};
use tokio::time::Instant;

/// One endpoint's adapters.
#[derive(Debug, Default)]
pub struct Adapters {
    /// The last scrape's figures and when they were read.
    scraped: RwLock<Option<(Arc<AdapterFigures>, Instant)>>,
    /// `max_lora` as last reported (0: never).
    max_loras: AtomicU32,
    /// This router's adapter requests in flight there, by adapter. Touched
    /// only by requests that name an adapter.
    in_flight: Mutex<Vec<(Arc<str>, u32)>>,
}

impl Adapters {
    /// Stores a scrape's figures (`None`: the engine exported none).
    pub fn set_scraped(&self, figures: Option<AdapterFigures>, at: Instant) {
        if let Some(f) = &figures
            && f.max_loras > 0
        {
            self.max_loras.store(f.max_loras, Ordering::Relaxed);
        }
        *self.scraped.write() = figures.map(|f| (Arc::new(f), at));
    }

    /// The last scrape's figures, with their age at `now`.
    pub fn scraped(&self, now: Instant) -> Option<(Arc<AdapterFigures>, Duration)> {
        self.scraped
            .read()
            .as_ref()
            .map(|(f, at)| (f.clone(), now.saturating_duration_since(*at)))
    }

    /// Where a request for `adapter` would stand there at `now`, trusting
    /// scraped figures younger than `max_age`.
    pub fn slot(&self, adapter: &str, now: Instant, max_age: Duration) -> AdapterSlot {
        let max = self.max_loras.load(Ordering::Relaxed) as usize;
        if max == 0 {
            return AdapterSlot::Unknown;
        }
        let fresh = self
            .scraped
            .read()
            .as_ref()
            .filter(|(_, at)| now.saturating_duration_since(*at) < max_age)
            .map(|(f, _)| f.clone());
        let own = self.in_flight.lock();
        if own.iter().any(|(a, _)| &**a == adapter)
            || fresh.as_ref().is_some_and(|f| f.has(adapter))
        {
            return AdapterSlot::Resident;
        }
        // Adapters holding or claiming a slot: the engine's running and
        // waiting ones and this router's own, each once.
        let mut busy = own.len();
        if let Some(f) = &fresh {
            for a in f.running.iter().chain(&f.waiting) {
                if !own.iter().any(|(o, _)| **o == **a) {
                    busy += 1;
                }
            }
        }
        if busy < max {
            AdapterSlot::Free
        } else {
            AdapterSlot::Full
        }
    }

    /// Counts a request for `adapter` as sent there.
    pub(crate) fn begin(&self, adapter: &Arc<str>) {
        let mut own = self.in_flight.lock();
        match own.iter_mut().find(|(a, _)| a == adapter) {
            Some((_, n)) => *n += 1,
            None => own.push((adapter.clone(), 1)),
        }
    }

    /// A request for `adapter` there has ended.
    pub(crate) fn end(&self, adapter: &str) {
        let mut own = self.in_flight.lock();
        if let Some(i) = own.iter().position(|(a, _)| &**a == adapter) {
            own[i].1 -= 1;
            if own[i].1 == 0 {
                own.swap_remove(i);
            }
        }
    }

    /// This router's adapters in flight there, with their request counts.
    pub fn in_flight(&self) -> Vec<(Arc<str>, u32)> {
        self.in_flight.lock().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(max: u32, running: &[&str], waiting: &[&str]) -> AdapterFigures {
        AdapterFigures {
            max_loras: max,
            running: running.iter().map(|s| (*s).to_owned()).collect(),
            waiting: waiting.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    const AGE: Duration = Duration::from_secs(2);

    #[test]
    fn slots_from_the_scrape_and_own_requests() {
        let a = Adapters::default();
        let now = Instant::now();
        assert_eq!(
            a.slot("sql", now, AGE),
            AdapterSlot::Unknown,
            "no gauge yet"
        );

        a.set_scraped(Some(figures(2, &["sql"], &[])), now);
        assert_eq!(a.slot("sql", now, AGE), AdapterSlot::Resident);
        assert_eq!(a.slot("math", now, AGE), AdapterSlot::Free);

        a.set_scraped(Some(figures(2, &["sql"], &["chat"])), now);
        assert_eq!(
            a.slot("chat", now, AGE),
            AdapterSlot::Resident,
            "waiting there"
        );
        assert_eq!(a.slot("math", now, AGE), AdapterSlot::Full);

        // Stale figures: only this router's own requests count, against the
        // max_lora last reported.
        let later = now + AGE;
        assert_eq!(a.slot("math", later, AGE), AdapterSlot::Free);
        let sql: Arc<str> = Arc::from("sql");
        let chat: Arc<str> = Arc::from("chat");
        a.begin(&sql);
        a.begin(&sql);
        assert_eq!(a.slot("sql", later, AGE), AdapterSlot::Resident);
        assert_eq!(a.slot("math", later, AGE), AdapterSlot::Free);
        a.begin(&chat);
        assert_eq!(a.slot("math", later, AGE), AdapterSlot::Full);
        // An own adapter the scrape also lists counts once.
        a.set_scraped(Some(figures(3, &["sql", "chat"], &[])), later);
        assert_eq!(a.slot("math", later, AGE), AdapterSlot::Free);
        a.set_scraped(Some(figures(2, &["sql", "chat"], &[])), later);
        assert_eq!(a.slot("math", later, AGE), AdapterSlot::Full);

        a.end("sql");
        assert_eq!(a.in_flight().len(), 2, "one sql request left");
        a.end("sql");
        a.end("chat");
        assert!(a.in_flight().is_empty());
        a.end("chat"); // an unknown end changes nothing
        // The gauge gone (engine restarted without adapters): max_lora is
        // kept, nothing runs.
        a.set_scraped(None, later);
        assert_eq!(a.slot("math", later, AGE), AdapterSlot::Free);
    }
}
