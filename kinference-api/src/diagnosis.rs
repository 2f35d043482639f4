//! The codes of `InferenceWorkerSet` diagnoses.
//!
//! Diagnoses are things a person should fix that do not stop routing. Each
//! has a stable reason code (below), a message that says what to change, and
//! the time it was first seen.

use std::fmt;
use std::str::FromStr;

/// A diagnosis code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DiagnosisReason {
    /// `kvEvents` is set but the endpoints' KV-event port refuses connections.
    KvPortClosed,
    /// `kvEvents` names a port the endpoints do not expose.
    KvPortMissing,
    /// Subscribed for a while and saw no KV events although the engine serves requests.
    NoKvEvents,
    /// The engines' events carry blocks of a width other than `kvBlockSize`.
    BlockSizeMismatch,
    /// Endpoints of one worker set serve different models.
    ModelMismatch,
    /// A model named in `spec.models` is not served by the engines.
    ModelNotServed,
    /// The engines could not be asked for their models.
    ModelsUnreachable,
    /// The router's tokenizer gives other token ids than the engine's `/tokenize`.
    TokenizerMismatch,
}

impl DiagnosisReason {
    /// Every code.
    pub const ALL: [DiagnosisReason; 8] = [
        DiagnosisReason::KvPortClosed,
        DiagnosisReason::KvPortMissing,
        DiagnosisReason::NoKvEvents,
        DiagnosisReason::BlockSizeMismatch,
        DiagnosisReason::ModelMismatch,
        DiagnosisReason::ModelNotServed,
        DiagnosisReason::ModelsUnreachable,
        DiagnosisReason::TokenizerMismatch,
    ];

    /// The code as written in status.
    pub fn as_str(self) -> &'static str {
        match self {
            DiagnosisReason::KvPortClosed => "KvPortClosed",
            DiagnosisReason::KvPortMissing => "KvPortMissing",
            DiagnosisReason::NoKvEvents => "NoKvEvents",
            DiagnosisReason::BlockSizeMismatch => "BlockSizeMismatch",
            DiagnosisReason::ModelMismatch => "ModelMismatch",
            DiagnosisReason::ModelNotServed => "ModelNotServed",
            DiagnosisReason::ModelsUnreachable => "ModelsUnreachable",
            DiagnosisReason::TokenizerMismatch => "TokenizerMismatch",
        }
    }
}

impl fmt::Display for DiagnosisReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown diagnosis code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown diagnosis reason {0:?}")]
pub struct UnknownDiagnosis(pub String);

impl FromStr for DiagnosisReason {
    type Err = UnknownDiagnosis;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DiagnosisReason::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| UnknownDiagnosis(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for r in DiagnosisReason::ALL {
            assert_eq!(r.as_str().parse::<DiagnosisReason>().unwrap(), r);
        }
        assert!("Nope".parse::<DiagnosisReason>().is_err());
    }
}
