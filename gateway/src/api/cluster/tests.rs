//! Every route of the API against the owners a kernel can have: where each goes.
use super::*;
use axum::http::Method;

/// Each route and method, then where it goes when the kernel (or snapshot) it names is here /
/// elsewhere (node-2) / away / gone / unknown: S served here, F forwarded to node-2,
/// A 503 (owner restarting), G 503 (owner not in the cluster), P placed, K every node's
/// kernels, V every node's approvals, T here then the others, O the others then here.
/// MCP rows without a session header; its session rows are in `mcp_sessions`.
const TABLE: &[(&str, &str, &str)] = &[
    ("GET", "/", "SSSSS"),
    ("GET", "/ui/{file}", "SSSSS"),
    ("GET", "/api", "SSSSS"),
    ("GET", "/api/openapi.json", "SSSSS"),
    ("GET", "/healthz", "SSSSS"),
    ("GET", "/readyz", "SSSSS"),
    ("GET", "/metrics", "SSSSS"),
    ("POST", "/v2/sandboxes", "PPPPP"),
    ("GET", "/v2/sandboxes", "SSSSS"),
    ("GET", "/sandboxes/{id}", "SFAGS"),
    ("DELETE", "/sandboxes/{id}", "SFAGS"),
    ("POST", "/sandboxes/{id}/timeout", "SFAGS"),
    ("POST", "/v2/sandboxes/{id}/connect", "SFAGS"),
    ("GET", "/sandboxes/{id}/metrics", "SFAGS"),
    ("PUT", "/sandboxes/{id}/network", "SFAGS"),
    ("POST", "/sandboxes/{id}/snapshots", "SFAGS"),
    ("GET", "/snapshots", "SSSSS"),
    ("DELETE", "/templates/{id}", "SSSSS"),
    ("POST", "/sandboxes/{id}/fork", "SFAGS"),
    ("POST", "/sandboxes/{id}/pause", "SFAGS"),
    ("GET", "/api/kernelspecs", "SSSSS"),
    ("GET", "/api/kernelspecs/{name}", "SSSSS"),
    ("GET", "/kernelspecs/{name}/{file}", "SSSSS"),
    ("GET", "/api/kernels", "KKKKK"),
    ("POST", "/api/kernels", "PPPPP"),
    ("GET", "/api/kernels/{id}", "SFAGS"),
    ("DELETE", "/api/kernels/{id}", "SFAGS"),
    ("POST", "/api/kernels/{id}/interrupt", "SFAGS"),
    ("POST", "/api/kernels/{id}/restart", "SFAGS"),
    ("POST", "/api/kernels/{id}/hibernate", "SFAGS"),
    ("POST", "/api/kernels/{id}/discard-state", "SFAGS"),
    ("POST", "/api/kernels/{id}/snapshots", "SFAGS"),
    ("POST", "/api/kernels/{id}/fork", "SFAGS"),
    ("GET", "/api/kernelgate/snapshots", "SSSSS"),
    ("GET", "/api/kernelgate/snapshots/{id}", "SFAGS"),
    ("DELETE", "/api/kernelgate/snapshots/{id}", "SFAGS"),
    ("GET", "/api/kernels/{id}/channels", "SFAGS"),
    ("POST", "/api/kernels/{id}/execute", "SFAGS"),
    ("POST", "/api/kernels/{id}/packages", "SFAGS"),
    ("GET", "/api/kernels/{id}/files", "SFAGS"),
    ("GET", "/api/kernels/{id}/files/{*path}", "SFAGS"),
    ("PUT", "/api/kernels/{id}/files/{*path}", "SFAGS"),
    ("DELETE", "/api/kernels/{id}/files/{*path}", "SFAGS"),
    ("GET", "/api/kernelgate/approvals", "VVVVV"),
    ("POST", "/api/kernelgate/approvals/{id}", "TTTTT"),
    ("GET", "/api/kernelgate/packages", "SSSSS"),
    ("POST", "/mcp", "SFAGS"),
    ("GET", "/mcp", "SSSSS"),
    ("DELETE", "/mcp", "SSSSS"),
];

use crate::cluster::route::tests::OWNERS;

fn code(decision: &Decision) -> char {
    match decision {
        Decision::Serve => 'S',
        Decision::Forward(node) if node == "node-2" => 'F',
        Decision::Forward(_) => '?',
        Decision::Unavailable(Unavailable::OwnerAway(_)) => 'A',
        Decision::Unavailable(Unavailable::OwnerGone(_)) => 'G',
        Decision::Unavailable(Unavailable::CutOff) => 'C',
        Decision::Place => 'P',
        Decision::FanOut(Fan::Kernels) => 'K',
        Decision::FanOut(Fan::Approvals) => 'V',
        Decision::HereThenOthers => 'T',
        Decision::OthersThenHere => 'O',
    }
}

/// Every (method, path) the router serves, with the rule its declaration gives it.
fn declared() -> Vec<(String, String, Rule)> {
    let super::super::Surface { public, protected } = super::super::surface();
    let mut rules: HashMap<String, Rule> = public.rules().iter().cloned().collect();
    rules.extend(protected.rules().iter().cloned());
    let mut routes = Vec::new();
    for part in [public, protected] {
        let (_, doc, prose) = part.split();
        for (path, item) in &doc.paths.paths {
            let methods = [
                ("GET", item.get.is_some()),
                ("PUT", item.put.is_some()),
                ("POST", item.post.is_some()),
                ("DELETE", item.delete.is_some()),
                ("PATCH", item.patch.is_some()),
            ];
            for (method, _) in methods.iter().filter(|(_, has)| *has) {
                routes.push((method.to_string(), path.clone(), rules[path]));
            }
        }
        for p in prose {
            let methods: &[&str] = match p.path {
                "/mcp" => &["POST", "GET", "DELETE"],
                _ => &["GET"],
            };
            for method in methods {
                routes.push((method.to_string(), p.path.to_owned(), rules[p.path]));
            }
        }
    }
    routes
}

#[test]
fn every_route_goes_where_its_kernel_is() {
    let declared = declared();
    let mut rows: Vec<(&str, &str)> = TABLE.iter().map(|(m, p, _)| (*m, *p)).collect();
    let mut routes: Vec<(&str, &str)> = declared
        .iter()
        .map(|(m, p, _)| (m.as_str(), p.as_str()))
        .collect();
    rows.sort();
    routes.sort();
    assert_eq!(
        rows, routes,
        "the table names every route the router serves"
    );
    for (method, path, rule) in &declared {
        let expected = TABLE
            .iter()
            .find(|(m, p, _)| m == method && p == path)
            .map(|(_, _, e)| *e)
            .unwrap_or_default();
        let got: String = OWNERS
            .iter()
            .map(|owner| {
                let ask = Ask {
                    method: method.parse::<Method>().expect("a method"),
                    kernel: *owner,
                    mcp_session: None,
                    registered: true,
                };
                code(&route::decide(*rule, &ask))
            })
            .collect();
        assert_eq!(got, expected, "{method} {path} ({rule:?})");
    }
}

#[test]
fn a_node_cut_off_from_the_registry_places_nothing_and_serves_the_rest_as_usual() {
    for (method, path, rule) in declared() {
        for owner in OWNERS {
            let ask = |registered| Ask {
                method: method.parse::<Method>().expect("a method"),
                kernel: owner,
                mcp_session: None,
                registered,
            };
            let (on, off) = (
                route::decide(rule, &ask(true)),
                route::decide(rule, &ask(false)),
            );
            if method == "POST" && (path == "/api/kernels" || path == "/v2/sandboxes") {
                assert_eq!(off, Decision::Unavailable(Unavailable::CutOff));
            } else {
                assert_eq!(on, off, "{method} {path} {owner:?}");
            }
        }
    }
}

#[test]
fn mcp_sessions_are_served_where_they_are_held() {
    for method in [Method::POST, Method::GET, Method::DELETE] {
        for owner in OWNERS {
            let ask = |held| Ask {
                method: method.clone(),
                kernel: owner,
                mcp_session: Some(held),
                registered: true,
            };
            assert_eq!(route::decide(Rule::Mcp, &ask(true)), Decision::Serve);
            assert_eq!(
                route::decide(Rule::Mcp, &ask(false)),
                Decision::OthersThenHere
            );
        }
    }
    assert_eq!(RULES.get("/mcp"), Some(&Rule::Mcp));
}

#[test]
fn a_sessionless_tool_call_is_routed_by_its_kernel_id_only() {
    let call = |body: serde_json::Value| mcp_kernel(body.to_string().as_bytes());
    let kernel = "6b0f1d4e-1111-4222-8333-444455556666";
    assert_eq!(
        call(
            serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "run_python", "arguments": {"kernel_id": kernel, "code": "1"}}})
        ),
        Some(kernel.to_owned())
    );
    for other in [
        serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "start_kernel", "arguments": {}}}),
        serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}),
        serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"arguments": {"kernel_id": 7}}}),
        serde_json::json!([1, 2]),
    ] {
        assert_eq!(call(other.clone()), None, "{other}");
    }
}
