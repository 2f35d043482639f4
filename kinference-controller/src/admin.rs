//! The admin HTTP server: `/metrics`, `/healthz`, `/readyz`.
//!
//! - `/metrics`: the Prometheus text format of the registry.
//! - `/healthz`: 200 while the process serves (liveness).
//! - `/readyz`: 200 once every cache has been filled, 503 before and after
//!   the controllers stop (readiness).

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// What the admin endpoints read.
#[derive(Clone)]
pub struct AdminState {
    registry: Arc<Registry>,
    ready: watch::Receiver<bool>,
}

impl std::fmt::Debug for AdminState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminState")
            .field("ready", &*self.ready.borrow())
            .finish_non_exhaustive()
    }
}

impl AdminState {
    /// Serves `registry`; ready while `ready` says so.
    pub fn new(registry: Arc<Registry>, ready: watch::Receiver<bool>) -> Self {
        AdminState { registry, ready }
    }
}

/// The routes.
pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(state)
}

async fn metrics(State(state): State<AdminState>) -> Response {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &state.registry) {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        )
            .into_response(),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "encoding metrics failed\n",
        )
            .into_response(),
    }
}

async fn readyz(State(state): State<AdminState>) -> Response {
    if *state.ready.borrow() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "caches not filled yet\n").into_response()
    }
}

/// Serves the admin routes on `listener` until `shutdown` is cancelled.
///
/// # Errors
/// When accepting connections fails.
pub async fn serve(
    listener: TcpListener,
    state: AdminState,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{Kind, Metrics};
    use bytes::Bytes;
    use http_body_util::{BodyExt, Empty};
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    use std::time::Duration;

    async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
        let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
        let resp = client
            .get(format!("http://{addr}{path}").parse().expect("a URI"))
            .await
            .expect("the admin server answers");
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.expect("a body").to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn serves_health_readiness_and_metrics() {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        metrics.reconciled(Kind::Pool, Duration::from_millis(1));
        let (ready_tx, ready) = watch::channel(false);
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let addr = listener.local_addr().expect("an address");
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(serve(
            listener,
            AdminState::new(Arc::new(registry), ready),
            shutdown.clone(),
        ));

        assert_eq!(get(addr, "/healthz").await, (200, "ok\n".into()));
        assert_eq!(get(addr, "/readyz").await.0, 503);
        ready_tx.send_replace(true);
        assert_eq!(get(addr, "/readyz").await, (200, "ready\n".into()));
        let (code, text) = get(addr, "/metrics").await;
        assert_eq!(code, 200);
        assert!(
            text.contains("kinference_controller_reconciles_total{kind=\"InferencePool\"} 1"),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");

        shutdown.cancel();
        server.await.expect("joins").expect("stops cleanly");
    }
}
