//! Stage 5, feedback: what the router learns from a response.
//!
//! The first body bytes of a streamed response are its time to first token
//! as the router sees it: they go to the metrics (the TTFT histogram, and
//! observed ÷ predicted) and to the policy's calibration of that endpoint
//! ([`kinference_scoring::Pick::observe`]). Its end gives the engine's
//! steps since then, which teach the policy the fleet's step costs
//! ([`kinference_scoring::Pick::observe_steps`]). Non-streamed responses
//! carry no first-token time and teach nothing.

use std::sync::Arc;
use std::time::Duration;

use kinference_scoring::{Choice, Pick as _};

use crate::metrics::{ModelLabels, WorkerSetLabels};
use crate::proxy::{OnFirstByte, OnStreamEnd};
use crate::runtime::WsRuntime;
use crate::state::Shared;

/// The hook a streamed response runs at its first bytes.
pub fn on_first_token(
    shared: &Arc<Shared>,
    runtime: &Arc<WsRuntime>,
    choice: &Choice,
    labels: ModelLabels,
) -> OnFirstByte {
    let (shared, runtime) = (shared.clone(), runtime.clone());
    let (endpoint, prediction) = (choice.endpoint, choice.prediction);
    Box::new(move |ttft: Duration| {
        let m = &shared.metrics;
        m.ttft.get_or_create(&labels).observe(ttft.as_secs_f64());
        if prediction.ttft_ms > 0.0 {
            m.ttft_ratio
                .get_or_create(&WorkerSetLabels {
                    worker_set: labels.worker_set.clone(),
                })
                .observe(ttft.as_secs_f64() * 1000.0 / prediction.ttft_ms);
        }
        let now = shared.now();
        runtime
            .policy
            .lock()
            .observe(endpoint, &prediction, ttft, now);
    })
}

/// The hook a streamed response runs at its end.
pub fn on_stream_end(runtime: &Arc<WsRuntime>, choice: &Choice) -> OnStreamEnd {
    let runtime = runtime.clone();
    let endpoint = choice.endpoint;
    Box::new(move |sample| {
        runtime.observe_steps(endpoint, &sample);
    })
}
