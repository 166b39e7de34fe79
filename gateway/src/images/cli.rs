//! `kernelgate image import|list`.

use super::{short_id, ImageStore, StoredImage};
use crate::config::{ImageAction, ImageArgs};

pub fn run(args: ImageArgs) -> anyhow::Result<()> {
    let store = ImageStore::open(args.image_store)?;
    match args.action {
        ImageAction::Import { file } => {
            let before: Vec<String> = store.list()?.into_iter().map(|i| i.id).collect();
            let imported = store.import(&file)?;
            for image in &imported {
                let verb = if before.contains(&image.id) {
                    "already stored"
                } else {
                    "imported"
                };
                println!(
                    "{verb} {} {} {} in {}",
                    image.id,
                    tags(image),
                    human(store.size(image)?),
                    image.rootfs.display()
                );
            }
            Ok(())
        }
        ImageAction::List => {
            let images = store.list()?;
            if images.is_empty() {
                eprintln!(
                    "the image store {} is empty: fill it with `kernelgate image import FILE`",
                    store.root().display()
                );
                return Ok(());
            }
            println!("{:<12}  {:>9}  TAGS", "ID", "SIZE");
            for image in &images {
                println!(
                    "{:<12}  {:>9}  {}",
                    short_id(&image.id),
                    human(store.size(image)?),
                    tags(image)
                );
            }
            Ok(())
        }
    }
}

fn tags(image: &StoredImage) -> String {
    if image.tags.is_empty() {
        "<untagged>".to_owned()
    } else {
        image.tags.join(",")
    }
}

fn human(bytes: u64) -> String {
    const MIB: f64 = 1024.0 * 1024.0;
    if bytes >= 1 << 30 {
        format!("{:.1}GiB", bytes as f64 / (MIB * 1024.0))
    } else if bytes >= 1 << 20 {
        format!("{:.1}MiB", bytes as f64 / MIB)
    } else {
        format!("{:.1}KiB", bytes as f64 / 1024.0)
    }
}
