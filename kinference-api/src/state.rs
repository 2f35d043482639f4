//! The state vocabulary of `InferenceWorkerSet` status and its rendering.
//!
//! `kubectl get iws` shows one STATE column: `Accepted`, or the reasons the
//! spec is rejected in place of it, then `NotReady` when no endpoint is ready
//! and `Unreferenced` when no `InferencePool` names the set:
//!
//! ```text
//! NAME               READY   STATE                            AGE
//! qwen-3-6-35b-a3b   3       Accepted                         7d
//! gemma-4-12b        0       Accepted,NotReady                7d
//! orphan             0       Accepted,NotReady,Unreferenced   19s
//! no-such-profile    0       UnknownProfile                   2m
//! ```
//!
//! A rejected set is not served at all, so its state shows only why it was
//! rejected: readiness and references are beside the point until it is fixed.

use std::fmt;
use std::str::FromStr;

/// One word of the STATE column.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum State {
    /// The spec is valid and every reference resolves.
    Accepted,
    /// No endpoint behind the Service is ready.
    NotReady,
    /// No `InferencePool` names this worker set.
    Unreferenced,
    /// Rejected: see [`Rejection`].
    Rejected(Rejection),
}

/// Why a worker set's spec is rejected. Each replaces `Accepted`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Rejection {
    /// `profile` names neither a built-in profile nor a `RoutingProfile`.
    UnknownProfile,
    /// `serviceRef.port` or `kvEvents.port` is not among the Service's ports
    /// (as seen in its EndpointSlices).
    InvalidPort,
    /// A model name or alias is also claimed by another worker set of a pool
    /// that names this one.
    AliasConflict,
    /// The `RoutingProfile` it names cannot be used (e.g. its tokenizer
    /// cannot be loaded).
    InvalidProfile,
}

impl Rejection {
    /// Every rejection, in the order they are rendered.
    pub const ALL: [Rejection; 4] = [
        Rejection::UnknownProfile,
        Rejection::InvalidProfile,
        Rejection::InvalidPort,
        Rejection::AliasConflict,
    ];

    /// The word as rendered, also used as the `Accepted` condition's reason.
    pub fn as_str(self) -> &'static str {
        match self {
            Rejection::UnknownProfile => "UnknownProfile",
            Rejection::InvalidPort => "InvalidPort",
            Rejection::AliasConflict => "AliasConflict",
            Rejection::InvalidProfile => "InvalidProfile",
        }
    }
}

impl State {
    /// The word as rendered.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Accepted => "Accepted",
            State::NotReady => "NotReady",
            State::Unreferenced => "Unreferenced",
            State::Rejected(r) => r.as_str(),
        }
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown word in a STATE string.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown worker set state {0:?}")]
pub struct UnknownState(pub String);

impl FromStr for State {
    type Err = UnknownState;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "Accepted" => Ok(State::Accepted),
            "NotReady" => Ok(State::NotReady),
            "Unreferenced" => Ok(State::Unreferenced),
            other => Rejection::ALL
                .into_iter()
                .find(|r| r.as_str() == other)
                .map(State::Rejected)
                .ok_or_else(|| UnknownState(other.to_owned())),
        }
    }
}

/// The facts a worker set's state is made of.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerSetState {
    /// Why the spec is rejected; empty when accepted.
    pub rejections: Vec<Rejection>,
    /// Ready endpoints behind the Service.
    pub ready_endpoints: u32,
    /// Whether some `InferencePool` names this set.
    pub referenced: bool,
}

impl WorkerSetState {
    /// Whether the spec is accepted.
    pub fn accepted(&self) -> bool {
        self.rejections.is_empty()
    }

    /// The state words, in the order they are rendered.
    pub fn states(&self) -> Vec<State> {
        if !self.accepted() {
            let mut rejections = self.rejections.clone();
            rejections.sort_by_key(|r| Rejection::ALL.iter().position(|a| a == r));
            rejections.dedup();
            return rejections.into_iter().map(State::Rejected).collect();
        }
        let mut states = vec![State::Accepted];
        if self.ready_endpoints == 0 {
            states.push(State::NotReady);
        }
        if !self.referenced {
            states.push(State::Unreferenced);
        }
        states
    }

    /// The STATE column, e.g. `Accepted,NotReady,Unreferenced`.
    pub fn render(&self) -> String {
        render(&self.states())
    }
}

/// Joins state words with commas, as the STATE column shows them.
pub fn render(states: &[State]) -> String {
    let mut out = String::new();
    for (i, s) in states.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(s.as_str());
    }
    out
}

/// Parses a STATE string back into its words.
///
/// # Errors
/// [`UnknownState`] for a word outside the vocabulary.
pub fn parse(s: &str) -> Result<Vec<State>, UnknownState> {
    if s.is_empty() {
        return Ok(Vec::new());
    }
    s.split(',').map(str::parse).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(rejections: &[Rejection], ready: u32, referenced: bool) -> WorkerSetState {
        WorkerSetState {
            rejections: rejections.to_vec(),
            ready_endpoints: ready,
            referenced,
        }
    }

    #[test]
    fn renders_the_seed_table() {
        assert_eq!(st(&[], 3, true).render(), "Accepted");
        assert_eq!(st(&[], 0, true).render(), "Accepted,NotReady");
        assert_eq!(st(&[], 0, false).render(), "Accepted,NotReady,Unreferenced");
        assert_eq!(st(&[], 2, false).render(), "Accepted,Unreferenced");
        assert_eq!(
            st(&[Rejection::UnknownProfile], 0, false).render(),
            "UnknownProfile"
        );
    }

    #[test]
    fn rejections_are_ordered_and_deduplicated() {
        let s = st(
            &[
                Rejection::AliasConflict,
                Rejection::UnknownProfile,
                Rejection::AliasConflict,
            ],
            5,
            true,
        );
        assert!(!s.accepted());
        assert_eq!(s.render(), "UnknownProfile,AliasConflict");
    }

    #[test]
    fn round_trips_through_parse() {
        for s in [
            st(&[], 3, true),
            st(&[], 0, false),
            st(
                &[Rejection::InvalidPort, Rejection::InvalidProfile],
                0,
                true,
            ),
        ] {
            assert_eq!(parse(&s.render()).unwrap(), s.states());
        }
        assert_eq!(parse("").unwrap(), Vec::<State>::new());
        assert_eq!(
            parse("Accepted,Bogus").unwrap_err(),
            UnknownState("Bogus".into())
        );
    }
}
