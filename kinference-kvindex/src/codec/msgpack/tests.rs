use proptest::prelude::*;

use super::*;

/// Token ids written the way `kind` says (some not minimal, some not
/// fitting u32 or signed), for `read_u32s` against `read_u32`.
fn encode_id(w: &mut Writer, v: u32, kind: u8) {
    let b = &mut w.buf;
    let written = match kind {
        1 => encode::write_u8(b, v as u8).is_ok(),
        2 => encode::write_u16(b, v as u16).is_ok(),
        3 => encode::write_u32(b, v).is_ok(),
        4 => encode::write_u64(b, u64::from(v)).is_ok(),
        5 => encode::write_i32(b, v as i32).is_ok(),
        6 => encode::write_pfix(b, (v & 0x7f) as u8).is_ok(),
        7 => encode::write_u64(b, u64::from(v) << 32).is_ok(),
        8 => encode::write_f32(b, v as f32).is_ok(),
        _ => encode::write_uint(b, u64::from(v)).is_ok(),
    };
    assert!(written);
}

/// The reference: `read_u32` once per id.
fn one_by_one(bytes: &[u8], n: usize) -> (Result<Vec<u32>, MsgError>, usize) {
    let mut r = Reader::new(bytes);
    let out = (0..n).map(|_| r.read_u32()).collect();
    (out, r.pos)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// The segmented fast path reads what `read_u32` reads one by one
    /// (values, position, and the same error on a bad or cut input),
    /// for every mix of encodings, with or without bytes after them.
    #[test]
    fn read_u32s_equals_reading_one_by_one(
        ids in prop::collection::vec(
            (any::<u32>(), prop_oneof![6 => Just(0u8), 1 => 0u8..9]),
            0..700,
        ),
        small in any::<bool>(),
        extra in 0usize..3,
        tail in prop::collection::vec(any::<u8>(), 0..40),
        cut in any::<prop::sample::Index>(),
        do_cut in prop::bool::weighted(0.2),
        flip in prop::option::weighted(0.2, (any::<prop::sample::Index>(), any::<u8>())),
    ) {
        let mut w = Writer::default();
        for &(v, kind) in &ids {
            // Mostly ids as vocabularies have them (below 2^18).
            let v = if small { v % 150_000 } else { v };
            encode_id(&mut w, v, kind);
        }
        let mut bytes = w.into_vec();
        bytes.extend_from_slice(&tail);
        if do_cut && !bytes.is_empty() {
            bytes.truncate(cut.index(bytes.len()));
        }
        if let Some((at, b)) = flip
            && !bytes.is_empty()
        {
            let at = at.index(bytes.len());
            bytes[at] = b;
        }
        let n = ids.len() + extra;
        let (want, want_pos) = one_by_one(&bytes, n);
        let mut r = Reader::new(&bytes);
        let mut got = vec![7u32];
        let res = r.read_u32s(n, &mut got);
        match want {
            Ok(want) => {
                prop_assert_eq!(res, Ok(()));
                prop_assert_eq!(&got[1..], &want[..]);
                prop_assert_eq!(got[0], 7);
                prop_assert_eq!(r.pos, want_pos);
            }
            Err(e) => prop_assert_eq!(res, Err(e)),
        }
    }

    /// Ids whose every byte is also a marker the fast path takes (so
    /// every byte gets a length a marker has): the lengths of the
    /// bytes inside an id must not lead the walk astray.
    #[test]
    fn read_u32s_where_every_byte_is_a_marker(
        ids in prop::collection::vec((any::<u32>(), any::<bool>()), 16..400),
    ) {
        // Each byte below 0x80 or one of 0xcc, 0xcd, 0xce.
        let marker = |b: u8| if b < 0x80 { b } else { 0xcc + b % 3 };
        let mut w = Writer::default();
        let mut want = Vec::new();
        for &(v, wide) in &ids {
            let v = u32::from_be_bytes(v.to_be_bytes().map(marker));
            let v = if wide { v } else { v & 0xffff };
            encode_id(&mut w, v, if wide { 3 } else { 2 });
            want.push(v);
        }
        w.uint(0);
        let mut r = Reader::new(w.bytes());
        let mut got = Vec::new();
        prop_assert_eq!(r.read_u32s(want.len(), &mut got), Ok(()));
        prop_assert_eq!(got, want);
        prop_assert_eq!(r.read_u32(), Ok(0));
    }
}

fn roundtrip(v: &Value) -> Value {
    let mut w = Writer::default();
    w.value(v);
    let mut r = Reader::new(w.bytes());
    let out = r.read_value().expect("reads back");
    assert!(r.is_empty());
    out
}

#[test]
fn integers_use_minimal_width_and_read_back() {
    for v in [
        0u64,
        127,
        128,
        255,
        256,
        65535,
        65536,
        u64::from(u32::MAX),
        1 << 32,
        u64::MAX,
    ] {
        assert_eq!(roundtrip(&Value::Uint(v)), Value::Uint(v));
    }
    for v in [
        -1i64,
        -32,
        -33,
        -128,
        -129,
        -32768,
        -32769,
        i64::from(i32::MIN) - 1,
        i64::MIN,
    ] {
        assert_eq!(roundtrip(&Value::Int(v)), Value::Int(v));
    }
    let mut w = Writer::default();
    w.uint(1 << 32);
    assert_eq!(w.bytes()[0], 0xcf, "msgspec writes >= 2^32 as uint64");
}

#[test]
fn truncated_and_invalid_input_is_an_error() {
    assert_eq!(
        Reader::new(&[0xcf, 0, 0]).read_int(),
        Err(MsgError::Truncated(1))
    );
    assert_eq!(Reader::new(&[0xc1]).skip(), Err(MsgError::Invalid(0)));
    // An array claiming 2^32-1 elements with nothing behind it.
    assert!(
        Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff])
            .read_array_len()
            .is_err()
    );
    // Deep nesting is refused, not a stack overflow.
    let deep = vec![0x91u8; 10_000];
    assert_eq!(Reader::new(&deep).skip(), Err(MsgError::Invalid(33)));
}
