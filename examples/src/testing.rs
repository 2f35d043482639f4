//! Helpers the integration tests of every crate share.

use std::future::Future;
use std::time::Duration;

/// What a polled check returns: `Some`/`Ok` when done, `None`/`Err(why)`
/// while not yet.
pub trait Outcome<T> {
    /// The value, or why not yet.
    ///
    /// # Errors
    /// When the check is not met yet.
    fn into_result(self) -> Result<T, String>;
}

impl<T> Outcome<T> for Option<T> {
    fn into_result(self) -> Result<T, String> {
        self.ok_or_else(|| "not yet".to_owned())
    }
}

impl<T> Outcome<T> for Result<T, String> {
    fn into_result(self) -> Result<T, String> {
        self
    }
}

/// Polls `check` until it is met, or panics after `within` naming `what`
/// and the last reason the check gave.
pub async fn eventually<T, R, F, Fut>(within: Duration, what: &str, mut check: F) -> T
where
    R: Outcome<T>,
    F: FnMut() -> Fut,
    Fut: Future<Output = R>,
{
    let deadline = tokio::time::Instant::now() + within;
    let poll = (within / 40).clamp(Duration::from_millis(20), Duration::from_millis(250));
    loop {
        match check().await.into_result() {
            Ok(v) => return v,
            Err(why) if tokio::time::Instant::now() >= deadline => {
                panic!("{what}: not reached within {within:?}: {why}")
            }
            Err(_) => tokio::time::sleep(poll).await,
        }
    }
}

/// The median of `v` (sorted in place); NaN for an empty slice.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        f64::midpoint(v[n / 2 - 1], v[n / 2])
    }
}

/// A loopback port on which nothing listens now (bound, then closed).
pub fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    l.local_addr().expect("an address").port()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert!((median(&mut [3.0, 1.0, 2.0]) - 2.0).abs() < 1e-12);
        assert!((median(&mut [4.0, 1.0, 2.0, 3.0]) - 2.5).abs() < 1e-12);
        assert!(median(&mut []).is_nan());
    }

    #[tokio::test]
    async fn eventually_returns_the_value_or_says_why() {
        let mut n = 0;
        let v = eventually(Duration::from_secs(5), "counting", || {
            n += 1;
            std::future::ready(if n >= 3 { Some(n) } else { None })
        })
        .await;
        assert_eq!(v, 3);
        let r = tokio::spawn(eventually(Duration::from_millis(50), "never", || {
            std::future::ready(Err::<(), _>("the reason".to_owned()))
        }))
        .await;
        let msg = r.unwrap_err().into_panic();
        let msg = msg.downcast_ref::<String>().unwrap();
        assert!(msg.contains("never") && msg.contains("the reason"), "{msg}");
    }
}
