//! Any text as a cell and as a user expression: the scanner decides, never panics, and
//! (on the stack the gateway gives it) never overflows.
#![no_main]

use kernelgate_policy::{Policy, Scope, STACK_BYTES};
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

const POLICY: &str = r#"
[[rule]]
action = "deny"
reason = "no subprocesses"
imports = ["subprocess"]
calls = ["os.system"]
shell = true

[[rule]]
action = "ask"
reason = "network"
imports = ["socket"]
"#;

fn policy() -> &'static Policy {
    static POLICY_ONCE: OnceLock<Policy> = OnceLock::new();
    POLICY_ONCE.get_or_init(|| Policy::from_toml(POLICY).expect("the fuzz policy parses"))
}

fuzz_target!(|data: &[u8]| {
    let code = String::from_utf8_lossy(data).into_owned();
    let scan = std::thread::Builder::new()
        .stack_size(STACK_BYTES)
        .spawn(move || {
            let mut scope = Scope::default();
            let _ = policy().check_in(&mut scope, &code, [code.as_str()]);
            let _ = policy().check_in(&mut scope, "x = 1", []);
        })
        .expect("thread");
    if let Err(panic) = scan.join() {
        std::panic::resume_unwind(panic);
    }
});
