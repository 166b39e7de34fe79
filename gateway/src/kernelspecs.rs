//! Kernel specs: the names clients create kernels by, each mapped to the image its
//! kernels run in, with what launchers show (display name, logos), the command the
//! container runs, and how many warm kernels it keeps.
//!
//! `python3` is always there (`--image`); `--kernelspec NAME=IMAGE` adds more. Display
//! names and logos come from the image's labels (see docs/custom-images.md):
//! `org.kernelgate.display_name`, `org.kernelgate.logo_png` (base64) and
//! `org.kernelgate.logo_svg`.

use crate::backend::{ImageFacts, KernelBackend};
use base64::Engine;
use std::collections::BTreeMap;

/// The spec every client gets when it names none.
pub const DEFAULT_SPEC: &str = "python3";

pub const LABEL_DISPLAY_NAME: &str = "org.kernelgate.display_name";
pub const LABEL_LOGO_PNG: &str = "org.kernelgate.logo_png";
pub const LABEL_LOGO_SVG: &str = "org.kernelgate.logo_svg";

/// Where the connection file is inside a kernel container; the kernelspec `argv` shows
/// `{connection_file}` in its place, as Jupyter's kernelspecs do.
pub const CONTAINER_CONNECTION_FILE: &str = "/run/kernel/kernel.json";

const DEFAULT_PNG: &[u8] = include_bytes!("../assets/logo-64x64.png");
const DEFAULT_SVG: &[u8] = include_bytes!("../assets/logo-svg.svg");
const DEFAULT_ARGV: [&str; 3] = [
    "/opt/kernel/venv/bin/python",
    "/opt/kernel/launch.py",
    "{connection_file}",
];

#[derive(Debug, Clone, PartialEq)]
pub struct KernelSpec {
    pub name: String,
    pub image: String,
    pub display_name: String,
    pub pool_size: usize,
    /// The command the container runs, with `{connection_file}`.
    pub argv: Vec<String>,
    pub logo_png: Vec<u8>,
    pub logo_svg: Vec<u8>,
    /// The image was found when the gateway started.
    pub image_present: bool,
}

/// All specs of this gateway, by name.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelSpecs {
    specs: BTreeMap<String, KernelSpec>,
}

impl KernelSpecs {
    /// From `--image`, `--kernelspec NAME=IMAGE` and `--pool-size [NAME=]N` values.
    pub fn parse(
        image: &str,
        kernelspecs: &[String],
        pool_sizes: &[String],
    ) -> Result<Self, String> {
        let mut specs = BTreeMap::new();
        specs.insert(
            DEFAULT_SPEC.to_owned(),
            KernelSpec::new(DEFAULT_SPEC, image),
        );
        for entry in kernelspecs {
            // An image reference may hold `:` (a tag, a registry port), never `=`.
            let (name, image) = entry.split_once('=').ok_or_else(|| {
                format!("--kernelspec {entry:?}: write NAME=IMAGE, e.g. sklearn=my-kernel:1")
            })?;
            let (name, image) = (name.trim(), image.trim());
            if !valid_name(name) {
                return Err(format!(
                    "--kernelspec {entry:?}: a spec name is letters, digits, '-', '_' and '.'"
                ));
            }
            if image.is_empty() {
                return Err(format!("--kernelspec {entry:?}: the image is missing"));
            }
            if specs
                .insert(name.to_owned(), KernelSpec::new(name, image))
                .is_some()
            {
                return Err(format!(
                    "--kernelspec {name} is given twice{}",
                    if name == DEFAULT_SPEC {
                        "; python3 is set with --image"
                    } else {
                        ""
                    }
                ));
            }
        }
        for entry in pool_sizes {
            let (name, n) = entry.split_once('=').unwrap_or((DEFAULT_SPEC, entry));
            let n: usize = n.trim().parse().map_err(|_| {
                format!("--pool-size {entry:?}: write N (for python3) or NAME=N, N a whole number")
            })?;
            let spec = specs.get_mut(name.trim()).ok_or_else(|| {
                format!("--pool-size {entry:?}: there is no kernel spec {name:?}")
            })?;
            spec.pool_size = n;
        }
        Ok(KernelSpecs { specs })
    }

    /// Reads display names, logos and commands from the images; notes missing images.
    pub async fn describe(&mut self, backend: &dyn KernelBackend) {
        for spec in self.specs.values_mut() {
            match backend.describe_image(&spec.image).await {
                Ok(facts) => spec.apply(&facts),
                Err(e) => {
                    tracing::warn!(spec = %spec.name, image = %spec.image, error = %e, "kernel spec unavailable");
                    spec.image_present = false;
                }
            }
        }
    }

    pub fn get(&self, name: &str) -> Option<&KernelSpec> {
        self.specs.get(name)
    }

    pub fn iter(&self) -> impl Iterator<Item = &KernelSpec> {
        self.specs.values()
    }

    /// The names, for messages: `python3, sklearn`.
    /// The spec names, sorted.
    pub fn names_list(&self) -> Vec<String> {
        self.specs.keys().cloned().collect()
    }

    pub fn names(&self) -> String {
        self.specs.keys().cloned().collect::<Vec<_>>().join(", ")
    }

    /// Warm kernels wanted in all pools.
    pub fn pool_target(&self) -> usize {
        self.specs.values().map(|s| s.pool_size).sum()
    }
}

impl KernelSpec {
    fn new(name: &str, image: &str) -> Self {
        KernelSpec {
            name: name.to_owned(),
            image: image.to_owned(),
            display_name: if name == DEFAULT_SPEC {
                "Python 3 (sandboxed)".to_owned()
            } else {
                format!("{name} (sandboxed)")
            },
            pool_size: usize::from(name == DEFAULT_SPEC) * 2,
            argv: DEFAULT_ARGV.map(str::to_owned).to_vec(),
            logo_png: DEFAULT_PNG.to_vec(),
            logo_svg: DEFAULT_SVG.to_vec(),
            image_present: true,
        }
    }

    fn apply(&mut self, facts: &ImageFacts) {
        self.image_present = true;
        if let Some(name) = facts
            .labels
            .get(LABEL_DISPLAY_NAME)
            .filter(|n| !n.is_empty())
        {
            self.display_name = name.clone();
        }
        let b64 = base64::engine::general_purpose::STANDARD;
        if let Some(png) = facts.labels.get(LABEL_LOGO_PNG) {
            match b64.decode(png.trim()) {
                Ok(bytes) if bytes.starts_with(b"\x89PNG") => self.logo_png = bytes,
                _ => {
                    tracing::warn!(image = %self.image, "label {LABEL_LOGO_PNG} is not a base64 PNG; using the default logo")
                }
            }
        }
        if let Some(svg) = facts
            .labels
            .get(LABEL_LOGO_SVG)
            .filter(|s| s.contains("<svg"))
        {
            self.logo_svg = svg.as_bytes().to_vec();
        }
        if !facts.cmd.is_empty() {
            self.argv = facts
                .cmd
                .iter()
                .map(|a| {
                    if a == CONTAINER_CONNECTION_FILE {
                        "{connection_file}".to_owned()
                    } else {
                        a.clone()
                    }
                })
                .collect();
        }
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && !name.starts_with('.')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn specs_map_names_to_images_with_their_pools() {
        let specs = KernelSpecs::parse(
            "kernelgate-kernel:abc",
            &strings(&[
                "sklearn=registry.local:5000/team/sk:1.2",
                "fixture=kg-fixture:x",
            ]),
            &strings(&["3", "sklearn=1"]),
        )
        .expect("valid");
        let py = specs.get(DEFAULT_SPEC).expect("python3");
        assert_eq!(
            (py.image.as_str(), py.pool_size),
            ("kernelgate-kernel:abc", 3)
        );
        let sk = specs.get("sklearn").expect("sklearn");
        assert_eq!(sk.image, "registry.local:5000/team/sk:1.2");
        assert_eq!(sk.pool_size, 1);
        assert_eq!(specs.get("fixture").map(|s| s.pool_size), Some(0));
        assert_eq!(specs.pool_target(), 4);
        assert_eq!(specs.names(), "fixture, python3, sklearn");
    }

    #[test]
    fn bad_specs_say_how_to_write_them() {
        let e = KernelSpecs::parse("i", &strings(&["no-image"]), &[]).expect_err("no =");
        assert!(e.contains("NAME=IMAGE"), "{e}");
        let e = KernelSpecs::parse("i", &strings(&["python3=x"]), &[]).expect_err("twice");
        assert!(e.contains("--image"), "{e}");
        let e = KernelSpecs::parse("i", &strings(&["a/b=x"]), &[]).expect_err("bad name");
        assert!(e.contains("letters"), "{e}");
        let e = KernelSpecs::parse("i", &[], &strings(&["nope=1"])).expect_err("unknown");
        assert!(e.contains("no kernel spec"), "{e}");
        let e = KernelSpecs::parse("i", &[], &strings(&["many"])).expect_err("not a number");
        assert!(e.contains("whole number"), "{e}");
    }

    #[test]
    fn image_labels_and_command_describe_the_spec() {
        let mut specs = KernelSpecs::parse("i", &strings(&["fx=f:1"]), &[]).expect("valid");
        let spec = specs.specs.get_mut("fx").expect("fx");
        let png = base64::engine::general_purpose::STANDARD.encode(b"\x89PNG\r\n\x1a\nrest");
        spec.apply(&ImageFacts {
            labels: [
                (
                    LABEL_DISPLAY_NAME.to_owned(),
                    "Python 3 + fixture".to_owned(),
                ),
                (LABEL_LOGO_PNG.to_owned(), png),
            ]
            .into(),
            cmd: strings(&[
                "/opt/kernel/venv/bin/python",
                "/opt/kernel/launch.py",
                CONTAINER_CONNECTION_FILE,
            ]),
            id: "sha256:0123456789ab".to_owned(),
            entrypoint: Vec::new(),
        });
        assert_eq!(spec.display_name, "Python 3 + fixture");
        assert!(spec.logo_png.starts_with(b"\x89PNG"));
        assert_eq!(spec.argv, DEFAULT_ARGV.map(str::to_owned).to_vec());
        assert_eq!(spec.logo_svg, DEFAULT_SVG, "no svg label: the default logo");
    }
}
