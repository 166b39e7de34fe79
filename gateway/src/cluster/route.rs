//! Where a request is served in cluster mode. Every route of the API declares its [`Rule`]
//! where it is declared (`api::surface`); [`decide`] turns the rule, the request's method
//! and what the registry says of the kernel it names into a [`Decision`]. Pure: the
//! middleware that reads the request and carries the decision out is `api/cluster/`.
//! Single-node mode (no `--etcd`) serves everything where it arrives.

use axum::http::Method;

/// How a route is served in a cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// Where it arrives: nothing of it lives on one node only (kernelspecs, the package
    /// allowlist, health, the UI), or it is the node's own (E2B's create and list: a
    /// sandbox is made, and listed, by the node it is asked of).
    Local,
    /// About the kernel of the path's `{id}`: its owner serves it.
    Kernel,
    /// About the snapshot of the path's `{id}`: the node that keeps it serves it, as an
    /// owner serves its kernel.
    Snapshot,
    /// `/api/kernels`: a create (`POST`) is placed on the node with the most free room; the
    /// list (`GET`) is every node's.
    Kernels,
    /// The approvals waiting (`GET`): every node's, oldest first.
    Approvals,
    /// An answer to one approval (`POST`): the node that holds it, asked in turn.
    Approval,
    /// MCP: a session's requests go to the node that holds the session; a sessionless tool
    /// call to the owner of the kernel its `kernel_id` names.
    Mcp,
    /// E2B's `/v2/sandboxes`: a create (`POST`) is placed as a kernel's; the list (`GET`)
    /// is the node reached's.
    Sandboxes,
    /// About one E2B sandbox: the path's `{id}` (the control plane) or the sandbox a
    /// sandbox-plane request names (`E2b-Sandbox-Id`, or its host). The node that runs its
    /// kernel serves it: the sandbox's record and its commands live there.
    Sandbox,
}

/// What the registry says of the kernel a request names, seen from this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner<'a> {
    /// In this node's kernel table.
    Here,
    /// Owned by another node that holds its lease.
    Elsewhere(&'a str),
    /// Owned by another node that is restarting (its record says away).
    Away(&'a str),
    /// Owned by a node that is not in the registry now.
    Gone(&'a str),
    /// No node holds it (or it names no kernel).
    Unknown,
}

/// What a request asks of the cluster, besides its route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ask<'a> {
    pub method: Method,
    /// The kernel the request names (the path's `{id}`, or a sessionless MCP tool call's
    /// `kernel_id`), or for [`Rule::Snapshot`] the snapshot: who holds it.
    pub kernel: Owner<'a>,
    /// MCP: the `Mcp-Session-Id` the request carries, and whether this node holds it.
    pub mcp_session: Option<bool>,
    /// This node holds its lease (registered within the TTL).
    pub registered: bool,
}

/// Where a request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// This node's handler answers (a kernel not here and unknown gets its 404).
    Serve,
    /// To the node that owns the kernel; ended if that node leaves the registry meanwhile.
    Forward(String),
    /// 503 with Retry-After, saying why.
    Unavailable(Unavailable),
    /// Placed: the candidates in order, the first with room takes it.
    Place,
    /// This node's rows and every other node's.
    FanOut(Fan),
    /// This node first, then each other node; the first that knows it answers.
    HereThenOthers,
    /// Each other node (the one remembered first), then this node's answer.
    OthersThenHere,
}

/// The lists that are every node's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fan {
    Kernels,
    Approvals,
}

/// Why a request cannot be served now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unavailable {
    /// The kernel's owner is restarting.
    OwnerAway(String),
    /// The kernel's owner is not in the registry.
    OwnerGone(String),
    /// This node holds no lease: a create could put a kernel where the cluster does not know
    /// it.
    CutOff,
}

/// Where a request of `rule` goes: see [`Decision`].
pub fn decide(rule: Rule, ask: &Ask<'_>) -> Decision {
    match rule {
        Rule::Local => Decision::Serve,
        Rule::Kernel | Rule::Snapshot | Rule::Sandbox => to_owner(ask.kernel),
        Rule::Kernels if ask.method == Method::POST => {
            if ask.registered {
                Decision::Place
            } else {
                Decision::Unavailable(Unavailable::CutOff)
            }
        }
        Rule::Kernels if ask.method == Method::GET => Decision::FanOut(Fan::Kernels),
        Rule::Sandboxes if ask.method == Method::POST => {
            if ask.registered {
                Decision::Place
            } else {
                Decision::Unavailable(Unavailable::CutOff)
            }
        }
        Rule::Approvals if ask.method == Method::GET => Decision::FanOut(Fan::Approvals),
        Rule::Approval if ask.method == Method::POST => Decision::HereThenOthers,
        Rule::Mcp => match ask.mcp_session {
            Some(true) => Decision::Serve,
            Some(false) => Decision::OthersThenHere,
            None if ask.method == Method::POST => to_owner(ask.kernel),
            None => Decision::Serve,
        },
        // A method the route does not take: the router's 405.
        Rule::Kernels | Rule::Sandboxes | Rule::Approvals | Rule::Approval => Decision::Serve,
    }
}

fn to_owner(owner: Owner<'_>) -> Decision {
    match owner {
        Owner::Here | Owner::Unknown => Decision::Serve,
        Owner::Elsewhere(node) => Decision::Forward(node.to_owned()),
        Owner::Away(node) => Decision::Unavailable(Unavailable::OwnerAway(node.to_owned())),
        Owner::Gone(node) => Decision::Unavailable(Unavailable::OwnerGone(node.to_owned())),
    }
}

/// Whether node `here` serves a call another node forwarded to it: not while it is cut off
/// from the registry and the node that sent it is not (it may hold a kernel the others
/// think gone). With the registry down for everyone, the last view still serves.
pub fn serves_forwarded(entry_registered: bool, registered: bool) -> bool {
    !entry_registered || registered
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Every kind of owner a kernel can have, another node's being node-2.
    pub(crate) const OWNERS: [Owner<'static>; 5] = [
        Owner::Here,
        Owner::Elsewhere("node-2"),
        Owner::Away("node-2"),
        Owner::Gone("node-2"),
        Owner::Unknown,
    ];

    fn ask(method: &Method, kernel: Owner<'static>) -> Ask<'static> {
        Ask {
            method: method.clone(),
            kernel,
            mcp_session: None,
            registered: true,
        }
    }

    #[test]
    fn a_kernels_owner_and_a_snapshots_keeper_serve_them_wherever_the_request_arrives() {
        let expected = [
            Decision::Serve,
            Decision::Forward("node-2".into()),
            Decision::Unavailable(Unavailable::OwnerAway("node-2".into())),
            Decision::Unavailable(Unavailable::OwnerGone("node-2".into())),
            Decision::Serve,
        ];
        for method in [Method::GET, Method::POST, Method::PUT, Method::DELETE] {
            for (owner, want) in OWNERS.iter().zip(&expected) {
                for rule in [Rule::Kernel, Rule::Snapshot] {
                    assert_eq!(
                        decide(rule, &ask(&method, *owner)),
                        *want,
                        "{rule:?} {owner:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn local_routes_never_leave_the_node() {
        for owner in OWNERS {
            for registered in [true, false] {
                let a = Ask {
                    registered,
                    ..ask(&Method::POST, owner)
                };
                assert_eq!(decide(Rule::Local, &a), Decision::Serve);
            }
        }
    }

    #[test]
    fn creates_are_placed_only_by_a_registered_node_and_lists_are_everyones() {
        let post = ask(&Method::POST, Owner::Unknown);
        assert_eq!(decide(Rule::Kernels, &post), Decision::Place);
        let cut_off = Ask {
            registered: false,
            ..post.clone()
        };
        assert_eq!(
            decide(Rule::Kernels, &cut_off),
            Decision::Unavailable(Unavailable::CutOff)
        );
        let get = ask(&Method::GET, Owner::Unknown);
        assert_eq!(decide(Rule::Kernels, &get), Decision::FanOut(Fan::Kernels));
        assert_eq!(
            decide(Rule::Approvals, &get),
            Decision::FanOut(Fan::Approvals)
        );
        assert_eq!(
            decide(Rule::Approval, &post),
            Decision::HereThenOthers,
            "an approval is answered where it is held"
        );
    }

    #[test]
    fn mcp_follows_its_session_else_the_kernel_it_names() {
        let held = Ask {
            mcp_session: Some(true),
            ..ask(&Method::POST, Owner::Elsewhere("node-2"))
        };
        assert_eq!(decide(Rule::Mcp, &held), Decision::Serve);
        let elsewhere = Ask {
            mcp_session: Some(false),
            ..held.clone()
        };
        assert_eq!(decide(Rule::Mcp, &elsewhere), Decision::OthersThenHere);
        for owner in OWNERS {
            assert_eq!(
                decide(Rule::Mcp, &ask(&Method::POST, owner)),
                decide(Rule::Kernel, &ask(&Method::POST, owner)),
                "a sessionless call goes where its kernel is: {owner:?}"
            );
            assert_eq!(
                decide(Rule::Mcp, &ask(&Method::GET, owner)),
                Decision::Serve
            );
        }
    }

    #[test]
    fn a_cut_off_node_refuses_forwarded_work_only_while_its_sender_is_registered() {
        assert!(serves_forwarded(true, true));
        assert!(!serves_forwarded(true, false));
        assert!(
            serves_forwarded(false, false),
            "the registry is down for all"
        );
        assert!(serves_forwarded(false, true));
    }
}
