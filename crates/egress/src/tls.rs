//! TLS interception for rules that need to see inside HTTPS (methods, paths, credentials): a CA
//! made for one cell, which the warden installs in that cell's trust store only, signs a
//! certificate for each host the cell connects to; upstreams are verified against the host's
//! roots (and a CA the policy names).

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::{ClientConfig, RootCertStore, ServerConfig};

/// Where Debian-like hosts keep their trusted roots.
const HOST_ROOTS: &str = "/etc/ssl/certs/ca-certificates.crt";

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("making the cell's certificate authority: {0}")]
    Ca(String),
    #[error("reading trusted roots from {path}: {message}")]
    Roots { path: String, message: String },
}

/// The cell's own certificate authority and the upstream trust.
pub struct Interceptor {
    ca: CertifiedIssuer<'static, KeyPair>,
    servers: Mutex<HashMap<String, Arc<ServerConfig>>>,
    client: Arc<ClientConfig>,
}

impl std::fmt::Debug for Interceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interceptor").finish_non_exhaustive()
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// What the gateway trusts when it speaks TLS to an upstream itself: the host's roots and the
/// policy's `extra_ca`.
pub(crate) fn upstream_client(extra_ca: Option<&Path>) -> Result<Arc<ClientConfig>, TlsError> {
    let mut roots = RootCertStore::empty();
    // A host without a CA bundle trusts only the policy's CA (or nothing, and says so when a
    // connection fails verification).
    let host_roots = Some(Path::new(HOST_ROOTS)).filter(|p| p.exists());
    for path in [host_roots, extra_ca].into_iter().flatten() {
        let roots_err = |message: String| TlsError::Roots {
            path: path.display().to_string(),
            message,
        };
        let certs = CertificateDer::pem_file_iter(path).map_err(|e| roots_err(e.to_string()))?;
        for cert in certs {
            let cert = cert.map_err(|e| roots_err(e.to_string()))?;
            let _ = roots.add(cert); // a malformed root is skipped, as by every TLS client
        }
    }
    let client = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Ca(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(client))
}

impl Interceptor {
    /// A fresh CA named after the cell; `extra_ca` is trusted for upstreams beside the host's.
    pub fn new(cell: &str, extra_ca: Option<&Path>) -> Result<Self, TlsError> {
        let ca_err = |e: rcgen::Error| TlsError::Ca(e.to_string());
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(ca_err)?;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.distinguished_name.push(
            DnType::CommonName,
            format!("Warden egress CA for cell {cell}"),
        );
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().map_err(ca_err)?)
            .map_err(ca_err)?;

        let client = upstream_client(extra_ca)?;
        Ok(Self {
            ca,
            servers: Mutex::new(HashMap::new()),
            client,
        })
    }

    /// The CA certificate the cell must trust, in PEM.
    pub fn ca_pem(&self) -> String {
        self.ca.pem()
    }

    /// A server configuration presenting a certificate for `host`, signed by the cell's CA.
    pub fn server_for(&self, host: &str) -> Result<Arc<ServerConfig>, TlsError> {
        if let Some(config) = self.servers.lock().ok().and_then(|s| s.get(host).cloned()) {
            return Ok(config);
        }
        let err = |e: String| TlsError::Ca(format!("certificate for {host}: {e}"));
        let key = KeyPair::generate().map_err(|e| err(e.to_string()))?;
        let params =
            CertificateParams::new(vec![host.to_owned()]).map_err(|e| err(e.to_string()))?;
        let cert = params
            .signed_by(&key, &self.ca)
            .map_err(|e| err(e.to_string()))?;
        let chain = vec![cert.der().clone(), self.ca.der().clone()];
        let private = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| err(e.to_string()))?
            .with_no_client_auth()
            .with_single_cert(chain, private)
            .map_err(|e| err(e.to_string()))?;
        let config = Arc::new(config);
        if let Ok(mut servers) = self.servers.lock() {
            servers.insert(host.to_owned(), config.clone());
        }
        Ok(config)
    }

    /// The client configuration for upstream connections.
    pub fn client(&self) -> Arc<ClientConfig> {
        self.client.clone()
    }
}
