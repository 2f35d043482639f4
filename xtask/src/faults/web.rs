//! HTTP helpers of the reliability suite: a client, whole and streamed answers, counters.

#[allow(clippy::wildcard_imports)]
use super::*;

pub(super) type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub(super) fn client(pool: usize) -> HttpClient {
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_max_idle_per_host(pool)
        .build(c)
}

pub(super) async fn request(
    c: &HttpClient,
    method: &str,
    url: &str,
    body: Option<&Value>,
) -> Result<http::Response<Incoming>> {
    let b = body.map_or_else(Bytes::new, |v| Bytes::from(v.to_string()));
    let req = http::Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json")
        .body(Full::new(b))?;
    Ok(c.request(req).await?)
}

/// A whole answer: status, served-by header, body.
pub(super) async fn call(c: &HttpClient, url: &str, body: &Value) -> Result<(u16, String, Bytes)> {
    let resp = request(c, "POST", url, Some(body)).await?;
    let status = resp.status().as_u16();
    let ep = served_by(&resp);
    let b = resp.into_body().collect().await?.to_bytes();
    Ok((status, ep, b))
}

pub(super) fn served_by(resp: &http::Response<Incoming>) -> String {
    resp.headers()
        .get("x-kinference-endpoint")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

pub(super) async fn get_json(c: &HttpClient, url: &str) -> Result<Value> {
    let resp = request(c, "GET", url, None).await?;
    let b = resp.into_body().collect().await?.to_bytes();
    Ok(serde_json::from_slice(&b)?)
}

pub(super) async fn get_text(c: &HttpClient, url: &str) -> Result<String> {
    let resp = request(c, "GET", url, None).await?;
    let b = resp.into_body().collect().await?.to_bytes();
    Ok(String::from_utf8_lossy(&b).into_owned())
}

/// How a streamed body ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Ending {
    Complete,
    Truncated,
    Error,
    Hang,
}

pub(super) async fn read_stream(
    mut body: Incoming,
    patience: Duration,
) -> (Ending, Option<Duration>, usize) {
    let started = Instant::now();
    let mut text = String::new();
    let mut first = None;
    loop {
        match tokio::time::timeout(patience, body.frame()).await {
            Err(_) => return (Ending::Hang, first, text.len()),
            Ok(None) => {
                let e = if text.trim_end().ends_with("data: [DONE]") {
                    Ending::Complete
                } else {
                    Ending::Truncated
                };
                return (e, first, text.len());
            }
            Ok(Some(Err(_))) => return (Ending::Error, first, text.len()),
            Ok(Some(Ok(f))) => {
                if let Some(d) = f.data_ref() {
                    if first.is_none() && !d.is_empty() {
                        first = Some(started.elapsed());
                    }
                    text.push_str(&String::from_utf8_lossy(d));
                }
            }
        }
    }
}

pub(super) fn words(start: usize, n: usize) -> String {
    (start..start + n)
        .map(|i| format!("w{}", i % 65_536))
        .collect::<Vec<_>>()
        .join(" ")
}

pub(super) fn chat(content: &str, stream: bool, max_tokens: u32) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": stream, "max_tokens": max_tokens})
}

/// The sum of metric `name`'s samples whose labels include each of
/// `labels` (the project's Prometheus parser; 0 when there are none).
pub(super) fn counter(metrics: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    kinference_api::engine::prometheus::samples(metrics)
        .filter(|s| s.is(name, labels))
        .map(|s| s.value)
        .sum()
}

pub(super) fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub(super) fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}
