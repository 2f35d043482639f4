//! Who may call the router, how the router calls engines, and TLS.
//!
//! - **Client API keys** (`--api-keys-file`): one key per line (`#`
//!   comments), as a Kubernetes Secret mounted as a file gives them; the
//!   file is re-read when it changes (a rotated Secret takes effect without
//!   a restart; a file that cannot be read keeps the keys in force). Clients
//!   send `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY`
//!   (Anthropic's). Health checks (`/health`, `/ready`) need no key. The
//!   client's credentials never reach the engines.
//! - **The engines' API key** (`--engine-api-key`, vLLM's and SGLang's
//!   `--api-key`): sent with every probe, discovery call and tokenization,
//!   and with requests: in place of the client's key when the router
//!   checked it, else only where the client sent no `Authorization`.
//! - **TLS** on the serving port (`--tls-cert-file`, `--tls-key-file`;
//!   rustls with the same crypto provider as the Kubernetes client), HTTP/2
//!   and HTTP/1.1 by ALPN.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use http::HeaderMap;
use http::header::{self, HeaderName, HeaderValue};
use tokio_util::sync::CancellationToken;

/// Anthropic's API-key header.
pub const X_API_KEY: HeaderName = HeaderName::from_static("x-api-key");

/// How often the keys file is checked for changes.
const RELOAD_EVERY: Duration = Duration::from_secs(5);

/// Errors loading keys or certificates.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// A file could not be read.
    #[error("reading {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The keys file holds no key.
    #[error("{0} holds no API key (one per line; lines starting with # are comments)")]
    NoKeys(PathBuf),
    /// A certificate or key did not parse or match.
    #[error("TLS: {0}")]
    Tls(String),
}

fn read(path: &Path) -> Result<String, AuthError> {
    std::fs::read_to_string(path).map_err(|source| AuthError::Read {
        path: path.to_owned(),
        source,
    })
}

fn parse_keys(text: &str) -> Vec<Box<[u8]>> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| l.as_bytes().into())
        .collect()
}

/// Equal in time that depends on the lengths only.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The API keys clients must present.
pub struct ClientKeys {
    path: PathBuf,
    keys: ArcSwap<Vec<Box<[u8]>>>,
}

impl std::fmt::Debug for ClientKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientKeys")
            .field("path", &self.path)
            .field("keys", &self.keys.load().len())
            .finish()
    }
}

impl ClientKeys {
    /// Reads the keys in `path`.
    ///
    /// # Errors
    /// The file cannot be read or holds no key.
    pub fn load(path: &Path) -> Result<Self, AuthError> {
        let keys = parse_keys(&read(path)?);
        if keys.is_empty() {
            return Err(AuthError::NoKeys(path.to_owned()));
        }
        Ok(Self {
            path: path.to_owned(),
            keys: ArcSwap::from_pointee(keys),
        })
    }

    /// Whether `headers` carry one of the keys.
    pub fn allows(&self, headers: &HeaderMap) -> bool {
        let Some(given) = presented(headers) else {
            return false;
        };
        // Every key compared, whichever matches.
        self.keys
            .load()
            .iter()
            .fold(false, |ok, k| same(k, given) | ok)
    }

    /// Re-reads the file when it changes, until `stop`.
    pub fn watch(self: &Arc<Self>, stop: CancellationToken) {
        let keys = self.clone();
        tokio::spawn(async move {
            let stamp = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
            let mut last: Option<SystemTime> = stamp(&keys.path);
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(RELOAD_EVERY) => {}
                }
                let now = stamp(&keys.path);
                if now == last {
                    continue;
                }
                match read(&keys.path).map(|t| parse_keys(&t)) {
                    Ok(k) if !k.is_empty() => {
                        tracing::info!(path = %keys.path.display(), keys = k.len(), "API keys reloaded");
                        keys.keys.store(Arc::new(k));
                        last = now;
                    }
                    Ok(_) => {
                        tracing::warn!(path = %keys.path.display(), "the API keys file is empty: keeping the keys in force");
                    }
                    Err(e) => tracing::warn!(error = %e, "keeping the API keys in force"),
                }
            }
        });
    }
}

/// The key a client presented: `Authorization: Bearer KEY` or `x-api-key`.
fn presented(headers: &HeaderMap) -> Option<&[u8]> {
    if let Some(v) = headers.get(header::AUTHORIZATION) {
        let b = v.as_bytes();
        let scheme = b"bearer ";
        if b.len() > scheme.len() && b[..scheme.len()].eq_ignore_ascii_case(scheme) {
            return Some(b[scheme.len()..].trim_ascii());
        }
    }
    headers.get(&X_API_KEY).map(|v| v.as_bytes().trim_ascii())
}

/// The `Authorization` value for the engines' API key.
///
/// # Errors
/// A key that cannot be a header value.
pub fn engine_authorization(key: &str) -> Result<HeaderValue, String> {
    let mut v = HeaderValue::from_str(&format!("Bearer {}", key.trim()))
        .map_err(|_| "the engine API key has characters a header cannot carry".to_owned())?;
    v.set_sensitive(true);
    Ok(v)
}

/// Headers as sent to an engine. When the router checked the client's key,
/// that key is dropped and the engines' key (if any) sent instead; when it
/// did not, a client's own `Authorization` passes untouched (clients that
/// hold the engines' key keep using it) and the engines' key fills in only
/// where the client sent none.
pub fn for_engine(headers: &mut HeaderMap, clients_checked: bool, engine: Option<&HeaderValue>) {
    if clients_checked {
        headers.remove(header::AUTHORIZATION);
        headers.remove(&X_API_KEY);
    }
    if let Some(v) = engine
        && !headers.contains_key(header::AUTHORIZATION)
    {
        headers.insert(header::AUTHORIZATION, v.clone());
    }
}

/// A TLS acceptor for the serving port from PEM files.
///
/// # Errors
/// Files that cannot be read or parsed, or a key that does not match.
pub fn tls_acceptor(cert: &Path, key: &Path) -> Result<tokio_rustls::TlsAcceptor, AuthError> {
    use rustls_pki_types::pem::PemObject as _;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let tls = |what: &str, e: &dyn std::fmt::Display| AuthError::Tls(format!("{what}: {e}"));
    let certs: Vec<CertificateDer<'static>> =
        CertificateDer::pem_slice_iter(read(cert)?.as_bytes())
            .collect::<Result<_, _>>()
            .map_err(|e| tls(&format!("certificates in {}", cert.display()), &e))?;
    if certs.is_empty() {
        return Err(AuthError::Tls(format!(
            "{} holds no certificate",
            cert.display()
        )));
    }
    let key = PrivateKeyDer::from_pem_slice(read(key)?.as_bytes())
        .map_err(|e| tls(&format!("private key in {}", key.display()), &e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| tls("protocol versions", &e))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| tls("certificate and key", &e))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(name: &str, value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            HeaderName::from_bytes(name.as_bytes()).unwrap(),
            HeaderValue::from_str(value).unwrap(),
        );
        h
    }

    #[test]
    fn keys_are_checked_from_either_header() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys");
        std::fs::write(&path, "# team a\nsk-one\n\n  sk-two  \n").unwrap();
        let k = ClientKeys::load(&path).unwrap();
        assert!(k.allows(&headers("authorization", "Bearer sk-one")));
        assert!(k.allows(&headers("authorization", "bearer sk-two")));
        assert!(k.allows(&headers("x-api-key", "sk-two")));
        assert!(!k.allows(&headers("authorization", "Bearer sk-three")));
        assert!(!k.allows(&headers("authorization", "Basic sk-one")));
        assert!(!k.allows(&headers("authorization", "Bearer # team a")));
        assert!(!k.allows(&HeaderMap::new()));
        std::fs::write(&path, "# nothing\n").unwrap();
        assert!(matches!(ClientKeys::load(&path), Err(AuthError::NoKeys(_))));
    }

    #[test]
    fn engines_get_their_key_and_never_the_clients() {
        let mut h = headers("authorization", "Bearer client");
        h.insert(X_API_KEY, HeaderValue::from_static("client"));
        let engine = engine_authorization("engine-key").unwrap();
        for_engine(&mut h, true, Some(&engine));
        assert_eq!(h[header::AUTHORIZATION], "Bearer engine-key");
        assert!(!h.contains_key(&X_API_KEY));
        let mut passed = headers("authorization", "Bearer client");
        for_engine(&mut passed, false, Some(&engine));
        assert_eq!(passed[header::AUTHORIZATION], "Bearer client");
        let mut none = HeaderMap::new();
        for_engine(&mut none, false, Some(&engine));
        assert_eq!(none[header::AUTHORIZATION], "Bearer engine-key");
    }
}
