//! Engines for tests: a loopback HTTP server answering `GET /v1/models` the
//! way vLLM does (an OpenAI model list; see the crate README).
//!
//! This is a stand-in until kinference-sim exists: it serves only the model
//! list, from a value the test can change while it runs.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// The models an engine serves: (id, max_model_len).
type Models = Arc<Mutex<Vec<(String, i64)>>>;

/// One fake engine's answer, changeable at run time.
#[derive(Clone, Debug)]
pub struct Engine {
    pub addr: SocketAddr,
    models: Models,
    stop: CancellationToken,
}

impl Engine {
    /// Serves `model` (context `max_model_len`) on `addr` (port 0: any).
    pub async fn start(addr: SocketAddr, model: &str, max_model_len: i64) -> Engine {
        let listener = TcpListener::bind(addr)
            .await
            .unwrap_or_else(|e| panic!("binding a test engine to {addr}: {e}"));
        let addr = listener.local_addr().expect("a bound address");
        let models: Models = Arc::new(Mutex::new(vec![(model.to_owned(), max_model_len)]));
        let stop = CancellationToken::new();
        let app = Router::new()
            .route("/v1/models", get(list))
            .with_state(models.clone());
        let s = stop.clone();
        tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(s.cancelled_owned())
                .await
                .expect("the test engine serves");
        });
        Engine { addr, models, stop }
    }

    /// Serves `model` from now on.
    pub fn serve(&self, model: &str, max_model_len: i64) {
        *self.models.lock().expect("not poisoned") = vec![(model.to_owned(), max_model_len)];
    }

    pub fn stop(&self) {
        self.stop.cancel();
    }
}

async fn list(State(models): State<Models>) -> axum::Json<serde_json::Value> {
    let models = models.lock().expect("not poisoned").clone();
    let data: Vec<serde_json::Value> = models
        .iter()
        .map(|(id, len)| {
            serde_json::json!({
                "id": id, "object": "model", "created": 1_767_225_600, "owned_by": "vllm",
                "root": id, "parent": null, "max_model_len": len, "permission": []
            })
        })
        .collect();
    axum::Json(serde_json::json!({"object": "list", "data": data}))
}
