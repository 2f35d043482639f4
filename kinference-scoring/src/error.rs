//! Errors for bad input. Nothing here panics on input data.

use crate::input::EndpointId;

/// A request or candidate set the policies cannot decide on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScoringError {
    /// The candidate slice was empty.
    #[error("no candidate endpoints")]
    NoCandidates,
    /// `Request::block_tokens` was 0.
    #[error("block width must be positive")]
    ZeroBlockWidth,
    /// An endpoint id at or above [`EndpointId::LIMIT`].
    #[error("endpoint id {0} is at or above the limit of {limit}", limit = EndpointId::LIMIT)]
    EndpointIdTooLarge(EndpointId),
}
