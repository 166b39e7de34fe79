//! Mutual TLS between the nodes of a cluster (`--cluster-listen` and the three
//! `--cluster-*-file` flags; docs/cluster.md). One CA signs every node's certificate, whose
//! subject alternative name is the node's id (`DNS:<node id>`). A node's cluster listener
//! takes only clients with such a certificate; a forwarding node talks only to a server
//! whose certificate names the node the registry says it is calling, so an address planted
//! in the registry leads to a handshake that fails before any request byte is sent.

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{flag} {}: cannot read it: {reason}", path.display())]
    Unreadable {
        flag: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("{flag} {}: no PEM {what} in it", path.display())]
    Empty {
        flag: &'static str,
        path: PathBuf,
        what: &'static str,
    },
    #[error("--cluster-ca-file {}: not a CA certificate this node can use: {reason}", path.display())]
    BadCa { path: PathBuf, reason: String },
    #[error(
        "--cluster-cert-file {}: its subject alternative names do not name this node ({node}); \
         make it with subjectAltName=DNS:{node} (docs/cluster.md)",
        path.display()
    )]
    NotThisNode { path: PathBuf, node: String },
    #[error(
        "--cluster-cert-file {} with --cluster-key-file {}: not a certificate and its private key: {reason}",
        cert.display(),
        key.display()
    )]
    BadIdentity {
        cert: PathBuf,
        key: PathBuf,
        reason: String,
    },
    #[error(
        "--node-id {0:?}: with --cluster-listen the node id is the DNS name its certificate \
         names; give letters, digits, '-' and '.'"
    )]
    NotAName(String),
}

/// This node's part of the cluster's TLS: the CA it trusts and the certificate it shows,
/// both as a server (its cluster listener) and as a client (the calls it forwards).
pub struct ClusterTls {
    provider: Arc<CryptoProvider>,
    roots: Arc<RootCertStore>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl std::fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterTls").finish_non_exhaustive()
    }
}

/// The name a node's certificate must carry: its id, as a DNS name.
pub fn node_name(node: &str) -> Result<ServerName<'static>, TlsError> {
    match ServerName::try_from(node.to_owned()) {
        Ok(name @ ServerName::DnsName(_)) => Ok(name),
        _ => Err(TlsError::NotAName(node.to_owned())),
    }
}

/// Whether certificate `cert` names node `node` among its subject alternative names (its
/// signature is the handshake's business).
pub fn names(cert: &CertificateDer<'_>, node: &str) -> bool {
    let (Ok(parsed), Ok(name)) = (ParsedCertificate::try_from(cert), node_name(node)) else {
        return false;
    };
    rustls::client::verify_server_name(&parsed, &name).is_ok()
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| TlsError::Unreadable {
        flag,
        path: path.to_owned(),
        reason: e.to_string(),
    })
}

fn certificates(flag: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(flag, path)?;
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem)
        .filter_map(Result::ok)
        .collect();
    if certs.is_empty() {
        return Err(TlsError::Empty {
            flag,
            path: path.to_owned(),
            what: "certificate",
        });
    }
    Ok(certs)
}

impl ClusterTls {
    /// Reads the CA, the certificate and its key, and checks that they fit together and
    /// that the certificate names `node`.
    pub fn load(ca: &Path, cert: &Path, key: &Path, node: &str) -> Result<ClusterTls, TlsError> {
        node_name(node)?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = RootCertStore::empty();
        for ca_cert in certificates("--cluster-ca-file", ca)? {
            roots.add(ca_cert).map_err(|e| TlsError::BadCa {
                path: ca.to_owned(),
                reason: e.to_string(),
            })?;
        }
        let chain = certificates("--cluster-cert-file", cert)?;
        let key_pem = read("--cluster-key-file", key)?;
        let private = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| TlsError::Empty {
            flag: "--cluster-key-file",
            path: key.to_owned(),
            what: "private key (PKCS#8, PKCS#1 or SEC1)",
        })?;
        if !names(&chain[0], node) {
            return Err(TlsError::NotThisNode {
                path: cert.to_owned(),
                node: node.to_owned(),
            });
        }
        let tls = ClusterTls {
            provider,
            roots: Arc::new(roots),
            chain,
            key: private,
        };
        // Both configurations once now, so that a key that does not fit its certificate
        // stops the start, not the first call.
        let bad_identity = |reason: String| TlsError::BadIdentity {
            cert: cert.to_owned(),
            key: key.to_owned(),
            reason,
        };
        tls.server_config().map_err(bad_identity)?;
        tls.client_config(node).map_err(bad_identity)?;
        Ok(tls)
    }

    /// The cluster listener's configuration: a client certificate signed by the cluster's
    /// CA is required (which node it names is checked per request, against the node the
    /// call says it comes from).
    pub fn server_config(&self) -> Result<Arc<ServerConfig>, String> {
        let clients =
            WebPkiClientVerifier::builder_with_provider(self.roots.clone(), self.provider.clone())
                .build()
                .map_err(|e| e.to_string())?;
        let config = ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_client_cert_verifier(clients)
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| e.to_string())?;
        Ok(Arc::new(config))
    }

    /// The configuration of calls to node `node`: its server certificate must be signed by
    /// the cluster's CA and name `node`, whatever address it was reached at.
    pub fn client_config(&self, node: &str) -> Result<Arc<ClientConfig>, String> {
        let name = node_name(node).map_err(|e| e.to_string())?;
        let inner =
            WebPkiServerVerifier::builder_with_provider(self.roots.clone(), self.provider.clone())
                .build()
                .map_err(|e| e.to_string())?;
        let config = ClientConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NodeVerifier { inner, node: name }))
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| e.to_string())?;
        Ok(Arc::new(config))
    }
}

/// The usual WebPKI check of a server certificate, against the node expected instead of
/// the host name the call was addressed to (an address in the registry can be planted; the
/// node id is what the registry says owns the kernel).
#[derive(Debug)]
struct NodeVerifier {
    inner: Arc<WebPkiServerVerifier>,
    node: ServerName<'static>,
}

impl ServerCertVerifier for NodeVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _addressed: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.inner
            .verify_server_cert(end_entity, intermediates, &self.node, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    };

    /// A CA that signs node certificates into a directory.
    pub(crate) struct Ca {
        cert: rcgen::Certificate,
        key: KeyPair,
        dir: tempfile::TempDir,
    }

    impl Ca {
        pub(crate) fn new() -> Ca {
            let key = KeyPair::generate().expect("key");
            let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params
                .distinguished_name
                .push(DnType::CommonName, "test CA");
            let cert = params.self_signed(&key).expect("CA");
            let dir = tempfile::tempdir().expect("dir");
            std::fs::write(dir.path().join("ca.pem"), cert.pem()).expect("write");
            Ca { cert, key, dir }
        }

        /// Node `node`'s files, its certificate naming `san`: (ca, cert, key).
        fn node(&self, node: &str, san: &str) -> (PathBuf, PathBuf, PathBuf) {
            let key = KeyPair::generate().expect("key");
            let mut params = CertificateParams::new(vec![san.to_owned()]).expect("params");
            params.extended_key_usages = vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ];
            let cert = params
                .signed_by(&key, &self.cert, &self.key)
                .expect("signed");
            let (c, k) = (
                self.dir.path().join(format!("{node}.pem")),
                self.dir.path().join(format!("{node}.key")),
            );
            std::fs::write(&c, cert.pem()).expect("write");
            std::fs::write(&k, key.serialize_pem()).expect("write");
            (self.dir.path().join("ca.pem"), c, k)
        }

        pub(crate) fn tls(&self, node: &str) -> ClusterTls {
            let (ca, cert, key) = self.node(node, node);
            ClusterTls::load(&ca, &cert, &key, node).expect("loads")
        }
    }

    /// A handshake of `client` calling node `expected` with `server`: the error, if any.
    async fn handshake(client: &ClusterTls, expected: &str, server: &ClusterTls) -> Option<String> {
        let (a, b) = tokio::io::duplex(64 * 1024);
        let acceptor = tokio_rustls::TlsAcceptor::from(server.server_config().expect("server"));
        let connector =
            tokio_rustls::TlsConnector::from(client.client_config(expected).expect("client"));
        let name = node_name(expected).expect("name");
        let (client, server) = tokio::join!(connector.connect(name, a), acceptor.accept(b));
        match (client, server) {
            (Ok(_), Ok(_)) => None,
            (Err(e), _) => Some(format!("client: {e}")),
            (_, Err(e)) => Some(format!("server: {e}")),
        }
    }

    #[tokio::test]
    async fn nodes_talk_only_to_the_node_they_expect_and_only_with_the_cluster_ca() {
        let ca = Ca::new();
        let (n1, n2) = (ca.tls("node-1"), ca.tls("node-2"));
        assert_eq!(handshake(&n1, "node-2", &n2).await, None);
        // A server that is another node than the one called: refused by the caller.
        let wrong = handshake(&n1, "node-3", &n2).await.expect("refused");
        assert!(
            wrong.starts_with("client:") && wrong.contains("certificate"),
            "{wrong}"
        );
        // A certificate of another CA, as a server and as a client: refused.
        let stranger = Ca::new().tls("node-2");
        let refused = handshake(&n1, "node-2", &stranger).await.expect("refused");
        assert!(refused.starts_with("client:"), "{refused}");
        assert!(handshake(&stranger, "node-1", &n1).await.is_some());
    }

    #[test]
    fn a_certificate_names_the_nodes_of_its_subject_alternative_names_only() {
        let ca = Ca::new();
        let (_, cert, _) = ca.node("node-1", "node-1");
        let der = CertificateDer::from_pem_file(&cert).expect("pem");
        assert!(names(&der, "node-1"));
        assert!(!names(&der, "node-2"));
        assert!(!names(&der, "node-1.evil"));
    }

    #[test]
    fn bad_files_name_the_flag_to_fix() {
        let ca = Ca::new();
        let (ca_file, cert, key) = ca.node("node-1", "node-1");
        let missing = ca.dir.path().join("missing.pem");
        let error = |ca: &Path, cert: &Path, key: &Path, node: &str| {
            ClusterTls::load(ca, cert, key, node)
                .expect_err("refused")
                .to_string()
        };
        let text = error(&missing, &cert, &key, "node-1");
        assert!(text.starts_with("--cluster-ca-file"), "{text}");
        let text = error(&ca_file, &key, &key, "node-1");
        assert!(text.starts_with("--cluster-cert-file"), "{text}");
        let text = error(&ca_file, &cert, &cert, "node-1");
        assert!(text.starts_with("--cluster-key-file"), "{text}");
        let text = error(&ca_file, &cert, &key, "node-2");
        assert!(text.contains("subjectAltName=DNS:node-2"), "{text}");
        let (_, _, other_key) = ca.node("node-2", "node-2");
        let text = error(&ca_file, &cert, &other_key, "node-1");
        assert!(
            text.contains("--cluster-cert-file") && text.contains("--cluster-key-file"),
            "{text}"
        );
        let text = error(&ca_file, &cert, &key, "node_1 x");
        assert!(text.starts_with("--node-id"), "{text}");
    }
}
