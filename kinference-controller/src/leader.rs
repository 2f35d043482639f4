//! Leader election, behind a seam: one instance writes status at a time.
//!
//! Every instance watches and keeps its caches warm; only the leader
//! reconciles (probes, writes status, publishes Events). [`Leadership`]
//! publishes whether this instance leads on a `watch` channel:
//! [`Leadership::always`] leads from the start (a single replica, or
//! `--leader-election=false`); [`Leadership::lease`] competes for a
//! `coordination.k8s.io/v1` Lease with kube-lease-manager, which renews it
//! while held and takes it over when its holder stops renewing.
//! [`Leadership::release`] gives the Lease up, so a successor need not wait
//! for it to expire.

use std::time::Duration;

use kube::Client;
use kube_lease_manager::{LeaseManager, LeaseManagerBuilder};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Where and as whom to compete for the Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseConfig {
    /// Name of the Lease.
    pub name: String,
    /// Its namespace (usually the controller's own).
    pub namespace: String,
    /// This instance's identity (usually the pod name).
    pub identity: String,
    /// How long a Lease is held without renewal.
    pub duration: Duration,
    /// How long before expiry the holder renews it.
    pub grace: Duration,
}

/// Why leader election could not start.
#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    /// kube-lease-manager refused the configuration or could not reach the Lease.
    #[error("cannot use Lease {namespace}/{name}")]
    Lease {
        /// The Lease's namespace.
        namespace: String,
        /// The Lease's name.
        name: String,
        /// The cause.
        #[source]
        source: kube_lease_manager::LeaseManagerError,
    },
    /// `grace` must be shorter than `duration`, both at least a second.
    #[error(
        "lease grace ({grace:?}) must be at least 1 s and shorter than its duration ({duration:?})"
    )]
    Durations {
        /// The Lease duration.
        duration: Duration,
        /// The renewal grace.
        grace: Duration,
    },
}

/// Whether this instance leads, now and as it changes.
#[derive(Debug)]
pub struct Leadership {
    rx: watch::Receiver<bool>,
    // Keeps the channel open for `always`.
    _tx: Option<watch::Sender<bool>>,
    lease: Option<LeaseTask>,
}

#[derive(Debug)]
struct LeaseTask {
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl Leadership {
    /// Leads from the start and never stops.
    pub fn always() -> Self {
        let (tx, rx) = watch::channel(true);
        Leadership {
            rx,
            _tx: Some(tx),
            lease: None,
        }
    }

    /// Competes for the Lease in `config` (creating it when absent).
    ///
    /// # Errors
    /// [`LeaderError`] when the durations are unusable or the Lease cannot be
    /// read or created.
    pub async fn lease(client: Client, config: LeaseConfig) -> Result<Self, LeaderError> {
        let (duration, grace) = (config.duration.as_secs(), config.grace.as_secs());
        if grace < 1 || grace >= duration {
            return Err(LeaderError::Durations {
                duration: config.duration,
                grace: config.grace,
            });
        }
        let manager: LeaseManager = LeaseManagerBuilder::new(client, &config.name)
            .with_namespace(&config.namespace)
            .with_identity(&config.identity)
            .with_duration(duration)
            .with_grace(grace)
            .with_field_manager(format!("{}-lease", crate::FIELD_MANAGER))
            .build()
            .await
            .map_err(|source| LeaderError::Lease {
                namespace: config.namespace.clone(),
                name: config.name.clone(),
                source,
            })?;
        let (tx, rx) = watch::channel(false);
        let stop = CancellationToken::new();
        let task = tokio::spawn(follow(manager, tx, stop.clone(), config));
        Ok(Leadership {
            rx,
            _tx: None,
            lease: Some(LeaseTask { stop, task }),
        })
    }

    /// Whether this instance leads now.
    pub fn is_leader(&self) -> bool {
        *self.rx.borrow()
    }

    /// A receiver that sees every change.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.rx.clone()
    }

    /// Stops competing and releases the Lease if held; afterwards this
    /// instance does not lead.
    pub async fn release(self) {
        if let Some(LeaseTask { stop, task }) = self.lease {
            stop.cancel();
            if let Err(error) = task.await {
                tracing::warn!(%error, "the leader-election task ended abnormally");
            }
        }
    }
}

/// Forwards kube-lease-manager's state to `tx` until `stop`, then releases.
async fn follow(
    manager: LeaseManager,
    tx: watch::Sender<bool>,
    stop: CancellationToken,
    config: LeaseConfig,
) {
    let (mut lease_rx, task) = manager.watch().await;
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            changed = lease_rx.changed() => {
                if changed.is_err() {
                    tracing::warn!(lease = %config.name, "the Lease manager stopped");
                    break;
                }
                let leader = *lease_rx.borrow_and_update();
                tracing::info!(lease = %config.name, identity = %config.identity, leader, "leadership changed");
                let _ = tx.send(leader);
            }
        }
    }
    // Closing the channel makes the manager release the Lease and return.
    drop(lease_rx);
    match task.await {
        Ok(Ok(_)) => tracing::info!(lease = %config.name, "released the Lease"),
        Ok(Err(error)) => {
            tracing::warn!(lease = %config.name, %error, "releasing the Lease failed");
        }
        Err(error) => tracing::warn!(lease = %config.name, %error, "the Lease task panicked"),
    }
    let _ = tx.send(false);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn always_leads() {
        let l = Leadership::always();
        assert!(l.is_leader());
        assert!(*l.subscribe().borrow());
        l.release().await;
    }
}
