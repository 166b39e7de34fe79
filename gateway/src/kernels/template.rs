//! Template starts, under an engine that restores checkpoints (docs/engines.md): per
//! image, one preloaded kernel is booted, checkpointed and kept in
//! `--hibernate-dir/templates/<image>`; kernels of that image then start by restoring it
//! (each with a new socket directory, key and session, reseeded random state, and the
//! template's empty home) instead of booting. A template that no longer restores (another
//! runsc, another image under the name) is made again; meanwhile kernels boot as before.
//! Kernels created with environment variables always boot: a restored process cannot take
//! a new environment.

use super::{Kernels, Limits};
use crate::backend::{BackendError, LaunchRequest, Launched};
use crate::relay::lifecycle::Event;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// Where an image's template is, and whether it is being made.
#[derive(Debug, Default)]
pub(super) struct Templates {
    building: Mutex<HashMap<String, ()>>,
}

/// The directory name of `image`'s template: the reference, made a plain name.
fn dir_name(image: &str) -> String {
    image
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The directory, under `--hibernate-dir`, of every template.
pub(in crate::kernels) const TEMPLATES: &str = "templates";
/// Inside a template's directory: the engine's checkpoint, and what it was made from.
const MEMORY: &str = "memory";
const RECORD: &str = "template.json";

impl Kernels {
    fn template_dir(&self, image: &str) -> PathBuf {
        self.settings
            .hibernate
            .dir
            .join(TEMPLATES)
            .join(dir_name(image))
    }

    fn templates_on(&self) -> bool {
        self.settings.templates && self.backend.capabilities().restore
    }

    /// Makes the templates of every spec's image that has none yet.
    pub(super) fn prepare_templates(self: &Arc<Self>) {
        if !self.templates_on() {
            return;
        }
        for spec in self.settings.specs.iter() {
            if !self.template_dir(&spec.image).join(MEMORY).is_dir() {
                self.build_template(&spec.name, &spec.image);
            }
        }
    }

    /// A kernel for `req` restored from its image's template, when there is one and the
    /// request can take it; `None` boots one instead.
    pub(super) async fn from_template(self: &Arc<Self>, req: &LaunchRequest) -> Option<Launched> {
        if !self.templates_on() || !req.env.is_empty() {
            return None;
        }
        let dir = self.template_dir(&req.image);
        let memory = dir.join(MEMORY);
        if !memory.is_dir() {
            self.build_template(&req.kernel_name, &req.image);
            return None;
        }
        match self.backend.restore_kernel(req, &memory).await {
            Ok(launched) => Some(launched),
            Err(e) => {
                tracing::warn!(image = %req.image, error = %e, "the image's template did not restore; it is made again, and this kernel boots");
                if matches!(e, BackendError::Refused(_))
                    || !memory.join("checkpoint.json").is_file()
                {
                    let _ = tokio::fs::remove_dir_all(&dir).await;
                    self.build_template(&req.kernel_name, &req.image);
                }
                None
            }
        }
    }

    /// Starts making `image`'s template (spec `name`), unless it is under way.
    fn build_template(self: &Arc<Self>, name: &str, image: &str) {
        {
            let mut building = self
                .templates
                .building
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if building.insert(image.to_owned(), ()).is_some() {
                return;
            }
        }
        let (me, name, image) = (self.clone(), name.to_owned(), image.to_owned());
        self.tracker.spawn(async move {
            match me.make_template(&name, &image).await {
                Ok(()) => tracing::info!(%image, "kernel template made: kernels of this image start from it"),
                Err(e) => tracing::warn!(%image, error = %e, "cannot make the image's kernel template; its kernels boot"),
            }
            me.templates
                .building
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&image);
        });
    }

    /// Boots a preloaded kernel of `name`, waits until it answers, checkpoints it into a
    /// temporary directory and moves that into place.
    async fn make_template(self: &Arc<Self>, name: &str, image: &str) -> Result<(), String> {
        let live = self
            .launch_booted(name, BTreeMap::new(), true, None, Limits::default())
            .await
            .map_err(|e| e.to_string())?;
        // Its watcher and link go: the checkpoint stops it on purpose.
        live.cancel.cancel();
        let _ = live.relay.step(Event::Unlinked).await;
        let handle = live.handle();
        // The template's own key, kept beside it: no clone answers it (each takes its own),
        // which is what this record lets an operator check.
        let record = serde_json::json!({
            "image": image,
            "made": chrono::Utc::now().to_rfc3339(),
            "key": live.process().connection.key,
        });
        let dir = self.template_dir(image);
        let parent = dir.parent().map(PathBuf::from).unwrap_or_default();
        let partial = parent.join(format!(
            ".{}.{}",
            dir_name(image),
            uuid::Uuid::new_v4().simple()
        ));
        let made = async {
            tokio::fs::create_dir_all(&partial)
                .await
                .map_err(|e| format!("{}: {e}", partial.display()))?;
            self.backend
                .checkpoint(&handle, &partial.join(MEMORY))
                .await
                .map_err(|e| e.to_string())?;
            tokio::fs::write(partial.join(RECORD), record.to_string())
                .await
                .map_err(|e| format!("{}: {e}", partial.display()))?;
            let _ = tokio::fs::remove_dir_all(&dir).await;
            tokio::fs::rename(&partial, &dir)
                .await
                .map_err(|e| format!("{}: {e}", dir.display()))
        }
        .await;
        if let Err(e) = self.backend.remove(&handle).await {
            tracing::warn!(sandbox = %handle, error = %e, "cannot remove a template's sandbox");
        }
        if made.is_err() {
            let _ = tokio::fs::remove_dir_all(&partial).await;
        }
        made
    }
}
