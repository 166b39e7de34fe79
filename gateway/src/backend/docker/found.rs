//! What a restarted gateway finds: the containers of its runtime directory, with the
//! records kept beside their socket directories (whom a warm kernel was handed to, which
//! kernel a container serves since a restart moved one into it).

use super::spec::{self, LABEL_KERNEL_ID, LABEL_MANAGED, LABEL_RUNTIME_DIR};
use super::{socket_dir, DockerBackend};
use crate::backend::{BackendError, Found};
use bollard::models::ContainerSummaryStateEnum;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

impl DockerBackend {
    /// The gateway's containers, as kernels to adopt or warm kernels to pool again.
    pub(super) async fn found(&self) -> Result<Vec<Found>, BackendError> {
        let containers = self
            .containers_labelled([
                format!("{LABEL_MANAGED}=true"),
                format!("{LABEL_RUNTIME_DIR}={}", self.runtime_dir_label()),
            ])
            .await?;
        // What the images are now: a warm kernel of a tag rebuilt since is stale.
        let mut image_ids = HashMap::new();
        for c in &containers {
            if let Some(image) = c.image.as_deref() {
                if !image_ids.contains_key(image) {
                    let id = self
                        .docker
                        .inspect_image(image)
                        .await
                        .ok()
                        .and_then(|i| i.id);
                    image_ids.insert(image.to_owned(), id);
                }
            }
        }
        let limits = spec::limits_label(
            self.settings.memory_mb,
            self.settings.cpus,
            self.settings.pids,
            self.settings.disk_mb,
        );
        let record = |kernel_id: &str, file: fn(&std::path::Path) -> PathBuf| {
            let dir = socket_dir::path(&self.settings.runtime_dir, kernel_id)?;
            let text = std::fs::read_to_string(file(&dir)).ok()?;
            Some(text.trim().to_owned()).filter(|t| !t.is_empty())
        };
        let found: Vec<Found> = containers
                .into_iter()
                .filter_map(|c| {
                    let handle = c.id?;
                    let mut labels = c.labels.unwrap_or_default();
                    let Some(label_id) = labels.remove(LABEL_KERNEL_ID) else {
                        tracing::warn!(container = %handle, "managed container without a kernel id label");
                        return None;
                    };
                    // Its sockets live under the id it was started for, whatever it serves.
                    let connection = self.host_connection(&label_id);
                    let owner = labels
                        .remove(spec::LABEL_OWNER)
                        .or_else(|| record(&label_id, owner_file));
                    let served = record(&label_id, kernel_file)
                        .filter(|id| socket_dir::path(&self.settings.runtime_dir, id).is_some());
                    let image = c.image.unwrap_or_default();
                    let current = labels.get(spec::LABEL_LIMITS) == Some(&limits)
                        && labels.get(spec::LABEL_RUNTIME).map(String::as_str)
                            == Some(self.runtime.name())
                        && c.image_id.is_some()
                        && image_ids.get(&image).cloned().flatten() == c.image_id;
                    Some(Found {
                        handle,
                        pooled: labels.contains_key(spec::LABEL_POOL)
                            && owner.is_none()
                            && served.is_none(),
                        current,
                        image,
                        owner,
                        kernel_name: labels.remove(spec::LABEL_KERNEL_NAME).unwrap_or_default(),
                        moved: served.is_some(),
                        kernel_id: served.unwrap_or(label_id),
                        running: c.state == Some(ContainerSummaryStateEnum::RUNNING),
                        connection,
                    })
                })
                .collect();
        Ok(found)
    }
}

/// Writes a small record beside a socket directory, in the gateway's runtime directory,
/// out of the kernel's reach.
pub(super) fn write_record(path: &Path, text: &str) -> Result<(), BackendError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()));
    written.map_err(|source| BackendError::SocketDir {
        path: path.display().to_string(),
        source,
    })
}

/// Which kernel a container started for the warm pool serves since a restart moved one
/// into it, beside its socket directory.
pub(super) fn kernel_file(socket_dir: &Path) -> PathBuf {
    socket_dir.with_extension("kernel")
}

/// Where the owner of a kernel handed out from the warm pool is recorded: beside its socket
/// directory, in the gateway's runtime directory, out of the kernel's reach.
pub(super) fn owner_file(socket_dir: &Path) -> PathBuf {
    socket_dir.with_extension("owner")
}
