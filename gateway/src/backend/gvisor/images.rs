//! Images for the engine from the image store ([`crate::images`]): the root filesystem
//! `kernelgate image import` unpacked once per image id, and the image's config.

use super::ResolvedImage;
use crate::backend::BackendError;
use crate::images::{ImageError, ImageStore, StoredImage};

/// What the engine is told when the store lacks an image.
const FIX: &str = "bring it into the image store with `kernelgate image import FILE` (FILE from \
                   `docker save IMAGE -o FILE` or `make image-archive`), with the same \
                   `--image-store` as the gateway";

/// `reference` from `store`, or [`BackendError::ImageMissing`] naming the fix.
pub fn resolve(store: &ImageStore, reference: &str) -> Result<ResolvedImage, BackendError> {
    match store.find(reference) {
        Ok(image) => Ok(resolved(image)),
        Err(ImageError::NotFound { .. }) => Err(BackendError::ImageMissing {
            image: reference.to_owned(),
            fix: FIX,
        }),
        Err(e) => Err(BackendError::Runtime(e.to_string())),
    }
}

fn resolved(image: StoredImage) -> ResolvedImage {
    let config = image.config;
    ResolvedImage {
        id: image.id,
        rootfs: image.rootfs,
        env: config.env,
        user: config.user.filter(|u| !u.is_empty()),
        working_dir: config.working_dir.filter(|w| !w.is_empty()),
        entrypoint: config.entrypoint,
        cmd: config.cmd,
        labels: config.labels,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_image_the_store_lacks_is_missing_with_the_fix() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = ImageStore::open(dir.path().join("store")).expect("store");
        let err = resolve(&store, "kernelgate-kernel:latest").expect_err("missing");
        assert!(matches!(err, BackendError::ImageMissing { .. }), "{err}");
        let text = err.to_string();
        assert!(
            text.contains("kernelgate-kernel:latest") && text.contains("kernelgate image import"),
            "{text}"
        );
    }
}
