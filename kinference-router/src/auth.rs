//! Who may call the router, how the router calls engines, and TLS.
//!
//! - **Client API keys** (`--api-keys-file`): one key per line (`#`
//!   comments), as a Kubernetes Secret mounted as a file gives them; the
//!   file is re-read when it changes (a rotated Secret takes effect without
//!   a restart; a file that cannot be read, or holds a line that does not
//!   parse, keeps the keys in force). A key may be followed, on its line,
//!   by `tenant=NAME` and `priority=N`: the tenant its requests are
//!   accounted to and their default and highest priority in admission
//!   ([`KeyClass`], [`crate::admit::Class`]). Clients send
//!   `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY`
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
    /// A line of the keys file does not parse (the message never quotes
    /// the key).
    #[error("{path} line {line}: {why}")]
    BadLine {
        /// The file.
        path: PathBuf,
        /// The line, from 1.
        line: usize,
        /// What is wrong with it.
        why: String,
    },
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

/// What a key says about the requests made with it: the tenant they are
/// accounted to and their priority in admission. Set by the operator in the
/// keys file, so a client cannot choose another tenant or a higher
/// priority with headers (see [`crate::admit::Class::resolve`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyClass {
    /// `tenant=NAME`: the tenant (at most [`crate::admit::MAX_TENANT_CHARS`]
    /// characters).
    pub tenant: Option<Arc<str>>,
    /// `priority=N`: the default priority and the highest the client may
    /// ask for with `x-kinference-priority` (±[`crate::admit::MAX_PRIORITY`]).
    pub priority: Option<i64>,
}

/// One key of the file and what it names.
struct Key {
    secret: Box<[u8]>,
    class: KeyClass,
}

/// The keys of a keys file: per line `KEY [tenant=NAME] [priority=N]`,
/// blank lines and `#` comments skipped.
///
/// # Errors
/// The 1-based line and why: an unknown or repeated field, an empty or too
/// long tenant, a priority that is not an integer within ±100, a key listed
/// twice. Messages never quote the key.
fn parse_keys(text: &str) -> Result<Vec<Key>, (usize, String)> {
    use crate::admit::{MAX_PRIORITY, MAX_TENANT_CHARS};
    let mut keys: Vec<(usize, Key)> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut fields = line.split_whitespace();
        let Some(secret) = fields.next() else {
            continue;
        };
        let mut class = KeyClass::default();
        for f in fields {
            if f.starts_with('#') {
                break; // a comment to the end of the line
            }
            let (name, value) = f.split_once('=').unwrap_or((f, ""));
            match name {
                "tenant" if class.tenant.is_some() => {
                    return Err((n, "tenant= is given twice".into()));
                }
                "tenant" => {
                    let chars = value.chars().count();
                    if chars == 0 || chars > MAX_TENANT_CHARS {
                        return Err((
                            n,
                            format!("tenant= must be 1 to {MAX_TENANT_CHARS} characters"),
                        ));
                    }
                    class.tenant = Some(value.into());
                }
                "priority" if class.priority.is_some() => {
                    return Err((n, "priority= is given twice".into()));
                }
                "priority" => match value.parse::<i64>() {
                    Ok(p) if p.abs() <= MAX_PRIORITY => class.priority = Some(p),
                    _ => {
                        return Err((
                            n,
                            format!(
                                "priority= must be an integer between -{MAX_PRIORITY} and {MAX_PRIORITY}"
                            ),
                        ));
                    }
                },
                _ => {
                    // The key itself is never repeated in a message: quote
                    // only a field's name, and only one that looks like one.
                    let plausible = f.contains('=')
                        && (1..=16).contains(&name.len())
                        && name.bytes().all(|b| b.is_ascii_alphabetic() || b == b'_');
                    let what = if plausible {
                        format!("unknown field {name:?}")
                    } else {
                        "an unknown field".to_owned()
                    };
                    return Err((
                        n,
                        format!(
                            "{what} after the key (a line is KEY, then optionally tenant=NAME and priority=N, separated by spaces)"
                        ),
                    ));
                }
            }
        }
        if let Some((first, _)) = keys
            .iter()
            .find(|(_, k)| same(&k.secret, secret.as_bytes()))
        {
            return Err((n, format!("the same key as line {first}")));
        }
        keys.push((
            n,
            Key {
                secret: secret.as_bytes().into(),
                class,
            },
        ));
    }
    Ok(keys.into_iter().map(|(_, k)| k).collect())
}

/// Equal in time that depends on the lengths only.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The API keys clients must present.
pub struct ClientKeys {
    path: PathBuf,
    keys: ArcSwap<Vec<Key>>,
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
    /// The file holds no key, or a line that does not parse.
    pub fn load(path: &Path) -> Result<Self, AuthError> {
        let keys = Self::parse(path, &read(path)?)?;
        Ok(Self {
            path: path.to_owned(),
            keys: ArcSwap::from_pointee(keys),
        })
    }

    fn parse(path: &Path, text: &str) -> Result<Vec<Key>, AuthError> {
        let keys = parse_keys(text).map_err(|(line, why)| AuthError::BadLine {
            path: path.to_owned(),
            line,
            why,
        })?;
        if keys.is_empty() {
            return Err(AuthError::NoKeys(path.to_owned()));
        }
        Ok(keys)
    }

    /// Whether `headers` carry one of the keys.
    pub fn allows(&self, headers: &HeaderMap) -> bool {
        self.check(headers).is_some()
    }

    /// The class of the key `headers` carry, or `None` when they carry
    /// none of the keys.
    pub fn check(&self, headers: &HeaderMap) -> Option<KeyClass> {
        let given = presented(headers)?;
        // Every key compared, whichever matches.
        let keys = self.keys.load();
        let found = keys.iter().fold(None, |found, k| {
            if same(&k.secret, given) {
                Some(k)
            } else {
                found
            }
        });
        found.map(|k| k.class.clone())
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
                match read(&keys.path).and_then(|t| Self::parse(&keys.path, &t)) {
                    Ok(k) => {
                        tracing::info!(path = %keys.path.display(), keys = k.len(), "API keys reloaded");
                        keys.keys.store(Arc::new(k));
                        last = now;
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
    fn a_key_may_name_its_tenant_and_priority() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys");
        std::fs::write(
            &path,
            "sk-plain\nsk-acme  tenant=acme priority=2\n\tsk-batch priority=-5 tenant=batch\nsk-t tenant=t # team t\n",
        )
        .unwrap();
        let k = ClientKeys::load(&path).unwrap();
        let class = |key: &str| k.check(&headers("authorization", &format!("Bearer {key}")));
        assert_eq!(class("sk-plain"), Some(KeyClass::default()));
        assert_eq!(
            class("sk-acme"),
            Some(KeyClass {
                tenant: Some("acme".into()),
                priority: Some(2)
            })
        );
        assert_eq!(
            class("sk-batch"),
            Some(KeyClass {
                tenant: Some("batch".into()),
                priority: Some(-5)
            })
        );
        assert_eq!(class("sk-t").and_then(|c| c.priority), None);
        // The fields are not part of the key.
        assert_eq!(class("sk-acme tenant=acme"), None);
        assert_eq!(class("tenant=acme"), None);
        assert!(k.allows(&headers("x-api-key", "sk-batch")));
    }

    #[test]
    fn a_bad_line_is_refused_with_its_number_and_never_the_key() {
        let cases = [
            ("sk-secret-1 team=acme\n", 1, "unknown field \"team\""),
            ("# c\nsk-secret-1 acme\n", 2, "an unknown field"),
            (
                "sk-secret-1 tenant=\n",
                1,
                "tenant= must be 1 to 64 characters",
            ),
            (
                "sk-secret-1 priority=high\n",
                1,
                "priority= must be an integer",
            ),
            ("sk-secret-1 priority=101\n", 1, "between -100 and 100"),
            (
                "sk-secret-1 tenant=a tenant=b\n",
                1,
                "tenant= is given twice",
            ),
            (
                "sk-secret-1\n\nsk-secret-1 tenant=a\n",
                3,
                "the same key as line 1",
            ),
        ];
        let long = format!("sk-secret-1 tenant={}\n", "x".repeat(65));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys");
        for (text, line, why) in
            cases
                .iter()
                .copied()
                .chain([(long.as_str(), 1, "1 to 64 characters")])
        {
            std::fs::write(&path, text).unwrap();
            let err = ClientKeys::load(&path).unwrap_err().to_string();
            assert!(
                err.contains(&format!("line {line}: ")) && err.contains(why),
                "{text:?}: {err}"
            );
            assert!(!err.contains("sk-secret"), "the key leaked: {err}");
        }
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
