//! Condition types, reasons and the one rule for updating a condition list.
//!
//! Conditions are `metav1.Condition`s in a list keyed by `type`. Each carries
//! the `observedGeneration` it was computed from; its `lastTransitionTime`
//! changes only when its `status` flips, so a status that is recomputed
//! without change is byte-for-byte the same and causes no write.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// `InferenceWorkerSet` and `InferencePool`: the spec is valid and usable.
pub const ACCEPTED: &str = "Accepted";
/// `InferenceWorkerSet`: at least one endpoint is ready.
pub const READY: &str = "Ready";
/// `InferenceWorkerSet`: some `InferencePool` names it.
pub const REFERENCED: &str = "Referenced";
/// `InferencePool`: every worker set it names exists and is accepted.
pub const RESOLVED_REFS: &str = "ResolvedRefs";

/// Reasons used with the condition types above (rejections use
/// [`crate::Rejection::as_str`]).
pub mod reason {
    /// The spec is valid.
    pub const ACCEPTED: &str = "Accepted";
    /// Ready endpoints exist.
    pub const ENDPOINTS_READY: &str = "EndpointsReady";
    /// No ready endpoint.
    pub const NO_READY_ENDPOINTS: &str = "NoReadyEndpoints";
    /// Some pool names the worker set.
    pub const REFERENCED_BY_POOL: &str = "ReferencedByPool";
    /// No pool names the worker set.
    pub const UNREFERENCED: &str = "Unreferenced";
    /// Every worker set of a pool resolved.
    pub const RESOLVED_REFS: &str = "ResolvedRefs";
    /// A pool names a worker set that does not exist.
    pub const WORKER_SET_NOT_FOUND: &str = "WorkerSetNotFound";
    /// A pool names a worker set that is rejected.
    pub const WORKER_SET_REJECTED: &str = "WorkerSetRejected";
    /// Two worker sets of a pool claim one name.
    pub const NAME_CONFLICT: &str = "NameConflict";
}

/// A condition to set, without its bookkeeping fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Desired<'a> {
    /// The condition `type`.
    pub type_: &'a str,
    /// `True` or `False`.
    pub status: bool,
    /// A CamelCase reason.
    pub reason: &'a str,
    /// A sentence for people.
    pub message: String,
}

/// Sets one condition in `conditions`, keyed by type.
///
/// `lastTransitionTime` is `now` when the condition is new or its status
/// flips, and is kept otherwise. Returns whether anything changed.
pub fn set(
    conditions: &mut Vec<Condition>,
    desired: &Desired<'_>,
    observed_generation: Option<i64>,
    now: &Time,
) -> bool {
    let status = if desired.status { "True" } else { "False" };
    let next = |last_transition_time: Time| Condition {
        last_transition_time,
        message: desired.message.clone(),
        observed_generation,
        reason: desired.reason.to_owned(),
        status: status.to_owned(),
        type_: desired.type_.to_owned(),
    };
    if let Some(c) = conditions.iter_mut().find(|c| c.type_ == desired.type_) {
        let since = if c.status == status {
            c.last_transition_time.clone()
        } else {
            now.clone()
        };
        let next = next(since);
        if *c == next {
            return false;
        }
        *c = next;
    } else {
        conditions.push(next(now.clone()));
    }
    true
}

/// Finds a condition by type.
pub fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Whether the condition of this type is `True`.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    find(conditions, type_).is_some_and(|c| c.status == "True")
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn at(secs: i64) -> Time {
        Time(Timestamp::from_second(secs).unwrap())
    }

    fn ready(status: bool, message: &str) -> Desired<'static> {
        Desired {
            type_: READY,
            status,
            reason: if status {
                reason::ENDPOINTS_READY
            } else {
                reason::NO_READY_ENDPOINTS
            },
            message: message.to_owned(),
        }
    }

    #[test]
    fn transition_time_moves_only_when_status_flips() {
        let mut cs = Vec::new();
        assert!(set(&mut cs, &ready(true, "3 ready"), Some(1), &at(100)));
        assert_eq!(cs[0].last_transition_time, at(100));

        // Same status, new message and generation: updated, time kept.
        assert!(set(&mut cs, &ready(true, "2 ready"), Some(2), &at(200)));
        assert_eq!(cs[0].last_transition_time, at(100));
        assert_eq!(cs[0].message, "2 ready");
        assert_eq!(cs[0].observed_generation, Some(2));

        // Identical: no change reported.
        assert!(!set(&mut cs, &ready(true, "2 ready"), Some(2), &at(300)));

        // Flip: time moves.
        assert!(set(&mut cs, &ready(false, "none ready"), Some(2), &at(400)));
        assert_eq!(cs[0].last_transition_time, at(400));
        assert_eq!(cs[0].status, "False");
        assert!(!is_true(&cs, READY));
        assert_eq!(cs.len(), 1);
    }
}
