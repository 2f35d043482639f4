//! `kinference-router events decode`: the same output as kinference-kvindex's
//! `kvdump`, from the same library code.

use std::path::Path;

/// Decodes a `.msgpack` payload or a `.frames` capture into JSON lines.
///
/// # Errors
/// When the file is neither.
pub fn decode_file(path: &Path, bytes: &[u8]) -> Result<String, String> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    kinference_kvindex::dump::decode_file(&name, bytes)
        .map_err(|e| format!("{}: {e}", path.display()))
}
