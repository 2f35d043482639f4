//! ZeroMQ framing of the KV-event stream (spec §1.2–1.3), independent of
//! any socket library, so the subscriber and the simulator share one
//! implementation.
//!
//! Live stream: every PUB message is `[topic, seq, payload]` with `seq` an
//! 8-byte big-endian u64. Replay: a DEALER sends `["", start_seq]`; the
//! ROUTER answers one message per buffered batch with `seq ≥ start_seq`,
//! then an end marker (seq = `ff×8`, empty payload), in one of two layouts
//! ([`ReplayLayout`]).

/// The sequence number of the replay end marker (−1 as signed 8 bytes).
pub const END_SEQ: u64 = u64::MAX;

/// Why frames could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// A message had another number of frames than the layout needs.
    #[error("expected {expected} frames, got {got}")]
    FrameCount {
        /// Frames the layout needs (for replay: after the delimiter).
        expected: &'static str,
        /// Frames received.
        got: usize,
    },
    /// The sequence frame was not 8 bytes.
    #[error("sequence frame has {0} bytes, expected 8")]
    SeqLength(usize),
    /// A `.frames` capture file is truncated or malformed.
    #[error("malformed frames container at byte {0}")]
    Container(usize),
}

/// How a ROUTER lays out replay replies (spec §1.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayLayout {
    /// vLLM 0.9.0–0.25.x, SGLang ≤ 0.5.21: `[seq, payload]`; end marker
    /// `[ff×8, ""]`.
    SeqPayload,
    /// vLLM ≥ 0.26, SGLang ≥ 0.5.22: `[topic, seq, payload]` like the live
    /// stream; end marker `["", ff×8, ""]`.
    TopicSeqPayload,
}

/// A sequence number as its 8-byte big-endian frame.
pub fn seq_to_bytes(seq: u64) -> [u8; 8] {
    seq.to_be_bytes()
}

/// Parses an 8-byte big-endian sequence frame.
///
/// # Errors
/// [`FrameError::SeqLength`] when the frame is not 8 bytes.
pub fn seq_from_bytes(frame: &[u8]) -> Result<u64, FrameError> {
    let a: [u8; 8] = frame
        .try_into()
        .map_err(|_| FrameError::SeqLength(frame.len()))?;
    Ok(u64::from_be_bytes(a))
}

/// One live-stream message, borrowed from its frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveMessage<'a> {
    /// Frame 0 (free text; empty for the default topic).
    pub topic: &'a [u8],
    /// Frame 1.
    pub seq: u64,
    /// Frame 2: one msgpack batch.
    pub payload: &'a [u8],
}

/// The three frames of a live message (what a PUB socket sends).
pub fn live_frames(topic: &[u8], seq: u64, payload: &[u8]) -> [Vec<u8>; 3] {
    [topic.to_vec(), seq_to_bytes(seq).to_vec(), payload.to_vec()]
}

/// Parses a live message as a SUB socket receives it.
///
/// # Errors
/// [`FrameError`] when there are not exactly 3 frames or the seq frame is
/// not 8 bytes.
pub fn parse_live<'a>(frames: &[&'a [u8]]) -> Result<LiveMessage<'a>, FrameError> {
    let [topic, seq, payload] = frames else {
        return Err(FrameError::FrameCount {
            expected: "3",
            got: frames.len(),
        });
    };
    Ok(LiveMessage {
        topic,
        seq: seq_from_bytes(seq)?,
        payload,
    })
}

/// The frames a DEALER sends to ask for replay from `start_seq`.
pub fn replay_request(start_seq: u64) -> [Vec<u8>; 2] {
    [Vec::new(), seq_to_bytes(start_seq).to_vec()]
}

/// Parses a replay request as a ROUTER receives it: `[identity, "", seq]`.
/// Returns the identity frame and the start sequence, or `None` for any
/// other shape (the engines ignore those without replying).
pub fn parse_replay_request<'a>(frames: &[&'a [u8]]) -> Option<(&'a [u8], u64)> {
    match frames {
        [identity, [], seq] => Some((identity, seq_from_bytes(seq).ok()?)),
        _ => None,
    }
}

/// The frames of one replayed batch, without the ROUTER's identity frame
/// and the empty delimiter (prepend both when sending from a ROUTER).
pub fn replay_batch_frames(
    layout: ReplayLayout,
    topic: &[u8],
    seq: u64,
    payload: &[u8],
) -> Vec<Vec<u8>> {
    match layout {
        ReplayLayout::SeqPayload => vec![seq_to_bytes(seq).to_vec(), payload.to_vec()],
        ReplayLayout::TopicSeqPayload => {
            vec![topic.to_vec(), seq_to_bytes(seq).to_vec(), payload.to_vec()]
        }
    }
}

/// The end-of-replay marker frames (without identity and delimiter).
pub fn replay_end_frames(layout: ReplayLayout) -> Vec<Vec<u8>> {
    match layout {
        ReplayLayout::SeqPayload => vec![seq_to_bytes(END_SEQ).to_vec(), Vec::new()],
        ReplayLayout::TopicSeqPayload => {
            vec![Vec::new(), seq_to_bytes(END_SEQ).to_vec(), Vec::new()]
        }
    }
}

/// One replay reply as a DEALER sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayReply<'a> {
    /// A buffered batch.
    Batch {
        /// Topic frame (new layout only).
        topic: Option<&'a [u8]>,
        /// Its sequence number.
        seq: u64,
        /// The msgpack batch.
        payload: &'a [u8],
    },
    /// The end marker: nothing more follows for this request.
    End,
}

/// Parses a reply as a DEALER receives it: an empty delimiter, then 2 or 3
/// frames (the layout is recognised by the count). A leading delimiter is
/// optional so callers may strip it first.
///
/// # Errors
/// [`FrameError`] for other frame counts or a bad seq frame.
pub fn parse_replay_reply<'a>(frames: &[&'a [u8]]) -> Result<ReplayReply<'a>, FrameError> {
    let body = match frames {
        [first, rest @ ..] if first.is_empty() && (rest.len() == 2 || rest.len() == 3) => rest,
        _ => frames,
    };
    let (topic, seq, payload) = match body {
        [seq, payload] => (None, seq_from_bytes(seq)?, *payload),
        [topic, seq, payload] => (Some(*topic), seq_from_bytes(seq)?, *payload),
        _ => {
            return Err(FrameError::FrameCount {
                expected: "2 or 3 after the delimiter",
                got: frames.len(),
            });
        }
    };
    if seq == END_SEQ && payload.is_empty() {
        return Ok(ReplayReply::End);
    }
    Ok(ReplayReply::Batch {
        topic,
        seq,
        payload,
    })
}

/// Splits a `.frames` capture (the fixtures' container: u32 big-endian
/// frame count, then per frame a u32 big-endian length and the bytes).
///
/// # Errors
/// [`FrameError::Container`] when the bytes do not add up.
pub fn read_frames_container(bytes: &[u8]) -> Result<Vec<&[u8]>, FrameError> {
    let u32_at = |at: usize| -> Result<usize, FrameError> {
        let s = bytes.get(at..at + 4).ok_or(FrameError::Container(at))?;
        Ok(u32::from_be_bytes([s[0], s[1], s[2], s[3]]) as usize)
    };
    let count = u32_at(0)?;
    let mut at = 4;
    let mut out = Vec::with_capacity(count.min(64));
    for _ in 0..count {
        let len = u32_at(at)?;
        at += 4;
        let end = at.checked_add(len).ok_or(FrameError::Container(at))?;
        out.push(bytes.get(at..end).ok_or(FrameError::Container(at))?);
        at = end;
    }
    if at != bytes.len() {
        return Err(FrameError::Container(at));
    }
    Ok(out)
}

/// Writes frames in the `.frames` container format (for captures).
pub fn write_frames_container(frames: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(frames.len() as u32).to_be_bytes());
    for f in frames {
        out.extend_from_slice(&(f.len() as u32).to_be_bytes());
        out.extend_from_slice(f);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_frames_round_trip_in_both_layouts() {
        for layout in [ReplayLayout::SeqPayload, ReplayLayout::TopicSeqPayload] {
            let f = replay_batch_frames(layout, b"kv@a", 7, b"\x93");
            let mut with_delim: Vec<&[u8]> = vec![b""];
            with_delim.extend(f.iter().map(Vec::as_slice));
            let got = parse_replay_reply(&with_delim).expect("parses");
            let want_topic = (layout == ReplayLayout::TopicSeqPayload).then_some(&b"kv@a"[..]);
            assert_eq!(
                got,
                ReplayReply::Batch {
                    topic: want_topic,
                    seq: 7,
                    payload: b"\x93"
                }
            );
            let end = replay_end_frames(layout);
            let end: Vec<&[u8]> = end.iter().map(Vec::as_slice).collect();
            assert_eq!(parse_replay_reply(&end), Ok(ReplayReply::End));
        }
    }

    #[test]
    fn requests_and_containers() {
        let req = replay_request(42);
        let frames: Vec<&[u8]> = vec![b"id", &req[0], &req[1]];
        assert_eq!(parse_replay_request(&frames), Some((&b"id"[..], 42)));
        assert_eq!(parse_replay_request(&frames[1..]), None);
        let c = write_frames_container(&[b"a", b"", b"xyz"]);
        assert_eq!(read_frames_container(&c), Ok(vec![&b"a"[..], b"", b"xyz"]));
        assert!(read_frames_container(&c[..c.len() - 1]).is_err());
        assert_eq!(seq_from_bytes(&[1, 2]), Err(FrameError::SeqLength(2)));
    }
}
