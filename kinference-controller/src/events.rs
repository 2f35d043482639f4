//! Kubernetes Events about worker sets, behind a seam.
//!
//! The reconciler announces what a person should look at: a diagnosis that
//! appears (Warning, reason = its code), a rejection that appears (Warning,
//! reason = the rejection) and a set that becomes accepted again (Normal,
//! `Accepted`). It hands each [`Notice`] to an [`EventSink`]:
//! [`KubeEvents`] publishes `events.k8s.io/v1` Events with kube-runtime's
//! `Recorder` (which folds repeats into a series); [`NoEvents`] drops them,
//! for clusters where the controller may not write Events.
//!
//! Notices are derived by [`notices`], a pure function of the previous and
//! the new status.

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::ObjectReference;
use kinference_api::InferenceWorkerSetStatus;
use kinference_api::conditions::{self, find};
use kube::Client;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};

/// The largest `note` an Event may carry (kube-apiserver's limit).
pub const MAX_NOTE: usize = 1024;

/// One Event to publish about a worker set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notice {
    /// Warning (something to fix) or Normal.
    pub warning: bool,
    /// CamelCase reason: a diagnosis code, a rejection or `Accepted`.
    pub reason: String,
    /// What happened and what to change (at most [`MAX_NOTE`] bytes).
    pub note: String,
    /// What the controller was doing: `Diagnose` or `Validate`.
    pub action: &'static str,
}

/// Where notices go.
pub trait EventSink: Send + Sync + 'static {
    /// Publishes `notice` about the object `regarding`.
    fn publish<'a>(
        &'a self,
        regarding: &'a ObjectReference,
        notice: &'a Notice,
    ) -> BoxFuture<'a, Result<(), kube::Error>>;
}

/// Publishes `events.k8s.io/v1` Events through kube-runtime's `Recorder`.
#[derive(Clone)]
pub struct KubeEvents {
    recorder: Recorder,
}

impl std::fmt::Debug for KubeEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeEvents").finish_non_exhaustive()
    }
}

impl KubeEvents {
    /// Events reported by `kinference-controller`, instance `instance`.
    pub fn new(client: Client, instance: Option<String>) -> Self {
        let reporter = Reporter {
            controller: crate::FIELD_MANAGER.to_owned(),
            instance,
        };
        KubeEvents {
            recorder: Recorder::new(client, reporter),
        }
    }
}

impl EventSink for KubeEvents {
    fn publish<'a>(
        &'a self,
        regarding: &'a ObjectReference,
        notice: &'a Notice,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        Box::pin(async move {
            let event = Event {
                type_: if notice.warning {
                    EventType::Warning
                } else {
                    EventType::Normal
                },
                reason: notice.reason.clone(),
                note: Some(notice.note.clone()),
                action: notice.action.to_owned(),
                secondary: None,
            };
            self.recorder.publish(&event, regarding).await
        })
    }
}

/// Drops every notice (`--events=false`).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoEvents;

impl EventSink for NoEvents {
    fn publish<'a>(
        &'a self,
        _regarding: &'a ObjectReference,
        _notice: &'a Notice,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        Box::pin(async { Ok(()) })
    }
}

/// Cuts `s` to at most `max` bytes on a character boundary.
fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// What changed between two statuses of a worker set that deserves an Event.
pub fn notices(
    prev: Option<&InferenceWorkerSetStatus>,
    next: &InferenceWorkerSetStatus,
) -> Vec<Notice> {
    let mut out = Vec::new();
    let was = prev.and_then(|p| find(&p.conditions, conditions::ACCEPTED));
    let now = find(&next.conditions, conditions::ACCEPTED);
    if let Some(now) = now {
        let changed = was.is_none_or(|w| w.status != now.status || w.reason != now.reason);
        if changed && now.status == "False" {
            out.push(Notice {
                warning: true,
                reason: now.reason.clone(),
                note: truncate(&now.message, MAX_NOTE),
                action: "Validate",
            });
        } else if changed && was.is_some_and(|w| w.status == "False") {
            out.push(Notice {
                warning: false,
                reason: now.reason.clone(),
                note: truncate(&now.message, MAX_NOTE),
                action: "Validate",
            });
        }
    }
    for d in &next.diagnoses {
        let known = prev.is_some_and(|p| p.diagnoses.iter().any(|q| q.reason == d.reason));
        if !known {
            out.push(Notice {
                warning: true,
                reason: d.reason.clone(),
                note: truncate(&d.message, MAX_NOTE),
                action: "Diagnose",
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::at;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
    use kinference_api::v1alpha1::Diagnosis;

    fn accepted(status: bool, reason: &str) -> Condition {
        Condition {
            type_: conditions::ACCEPTED.into(),
            status: if status { "True" } else { "False" }.into(),
            reason: reason.into(),
            message: format!("because {reason}"),
            observed_generation: Some(1),
            last_transition_time: at(1),
        }
    }

    fn status(c: Condition, diagnoses: &[&str]) -> InferenceWorkerSetStatus {
        InferenceWorkerSetStatus {
            conditions: vec![c],
            diagnoses: diagnoses
                .iter()
                .map(|r| Diagnosis {
                    reason: (*r).into(),
                    message: format!("{r} seen"),
                    since: at(1),
                })
                .collect(),
            ..Default::default()
        }
    }

    fn reasons(n: &[Notice]) -> Vec<(bool, &str)> {
        n.iter().map(|n| (n.warning, n.reason.as_str())).collect()
    }

    #[test]
    fn new_findings_and_rejections_are_announced_once() {
        let ok = status(accepted(true, "Accepted"), &[]);
        let bad = status(accepted(false, "UnknownProfile"), &[]);
        let diag = status(accepted(true, "Accepted"), &["ModelMismatch"]);
        let more = status(
            accepted(true, "Accepted"),
            &["ModelMismatch", "ModelNotServed"],
        );

        assert_eq!(reasons(&notices(None, &ok)), []);
        assert_eq!(reasons(&notices(None, &bad)), [(true, "UnknownProfile")]);
        assert_eq!(reasons(&notices(Some(&bad), &bad)), []);
        assert_eq!(reasons(&notices(Some(&bad), &ok)), [(false, "Accepted")]);
        assert_eq!(
            reasons(&notices(Some(&ok), &diag)),
            [(true, "ModelMismatch")]
        );
        assert_eq!(reasons(&notices(Some(&diag), &diag)), []);
        assert_eq!(
            reasons(&notices(Some(&diag), &more)),
            [(true, "ModelNotServed")]
        );
        assert_eq!(reasons(&notices(Some(&more), &ok)), []);
        let n = notices(Some(&ok), &diag);
        assert_eq!(n[0].note, "ModelMismatch seen");
        assert_eq!(n[0].action, "Diagnose");
    }

    #[test]
    fn notes_are_cut_on_a_character_boundary() {
        let long = "é".repeat(MAX_NOTE);
        let cut = truncate(&long, MAX_NOTE);
        assert!(cut.len() <= MAX_NOTE);
        assert_eq!(cut.chars().count(), MAX_NOTE / 2);
        assert_eq!(truncate("short", MAX_NOTE), "short");
    }
}
