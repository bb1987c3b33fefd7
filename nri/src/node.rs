//! The node service, from the NRI plugin's side: what the plugin asks of it, behind one trait
//! ([`Node`]; [`NodeSocket`] asks the real one, the plugin's tests a stub).

use std::collections::BTreeMap;
use std::time::Duration;

use gpuplex_hook::stages::{self, HookContext, Prepared};
use gpuplex_scheduler::node::ReleaseKey;
use gpuplex_scheduler::Handle;
use gpuplex_wire::identity;
use gpuplex_wire::{ClientError, NodeClient};
use serde_json::Value;

/// What the plugin asks of the node service, each call about one container.
pub trait Node {
    /// Reserves a vGPU for the container whose spec (as [`crate::spec::spec_of`] makes it) asks
    /// for one by its `gpuplex.io/` annotations, and edits the spec for it: podman's precreate
    /// and the shim's `Create`. `None` when it asks for none. On failure nothing is reserved.
    fn prepare(&self, spec: &Value) -> Result<Option<Prepared>, String>;
    /// Undoes a [`Node::prepare`] whose adjustment could not be made.
    fn undo(&self, prepared: &Prepared);
    /// Attaches container `id`, whose init is `pid`, to the vGPU of `handle`; `unstarted`:
    /// its init has not started the container's program yet; `asked`: what a device plugin
    /// allocation's container asks for its vGPU (empty for any other).
    fn attach(
        &self,
        handle: &Handle,
        id: &str,
        pid: u32,
        unstarted: bool,
        asked: &BTreeMap<String, String>,
    ) -> Result<(), String>;
    /// Releases the vGPU reserved with `handle`, if it is still there; best effort: the node
    /// service also releases a vGPU whose container's processes are gone.
    fn release(&self, handle: &Handle);
    /// Bounds each request to the node service to `limit`: the runtime gives up on a plugin
    /// that does not answer within its request timeout, and then creates containers without it.
    fn answer_within(&mut self, _limit: Duration) {}
}

/// How long a request to the node service may take before the runtime has said its own timeout:
/// three quarters of NRI's default (2 s).
pub const ANSWER_WITHIN: Duration = Duration::from_millis(1500);

/// The node service on its socket, as `gpuplex.toml` names it.
pub struct NodeSocket {
    /// The socket, the identity directory and the CDI settings, with the shim's rules (the
    /// pod's name and namespace passed on, no hook in the spec).
    ctx: HookContext,
}

impl NodeSocket {
    /// The node service of the configuration `ctx` was read from.
    pub fn new(ctx: HookContext) -> NodeSocket {
        NodeSocket {
            ctx: ctx.for_shim().with_timeout(ANSWER_WITHIN),
        }
    }

    fn client(&self) -> Result<NodeClient, String> {
        NodeClient::connect_with_timeout(&self.ctx.socket, self.ctx.timeout)
            .map_err(|e| e.to_string())
    }
}

impl Node for NodeSocket {
    fn prepare(&self, spec: &Value) -> Result<Option<Prepared>, String> {
        let bytes = serde_json::to_vec(spec).map_err(|e| e.to_string())?;
        stages::prepare(&self.ctx, &bytes).map_err(|e| e.message)
    }

    fn undo(&self, prepared: &Prepared) {
        self.release(&prepared.handle);
        let _ = identity::remove(&self.ctx.identity_dir, prepared.vgpu);
    }

    fn attach(
        &self,
        handle: &Handle,
        id: &str,
        pid: u32,
        unstarted: bool,
        asked: &BTreeMap<String, String>,
    ) -> Result<(), String> {
        let mut client = self.client()?;
        match client.attach_asking(handle, id, pid, unstarted, asked) {
            Ok(vgpu) => {
                // The identity now names its container.
                let ours = identity::Identity::of(&vgpu, &self.ctx.node);
                let _ = identity::write(&self.ctx.identity_dir, &ours);
                Ok(())
            }
            Err(ClientError::Refused(why)) => {
                Err(format!("the gpuplex node service refused: {why}"))
            }
            Err(e) => Err(e.to_string()),
        }
    }

    fn release(&self, handle: &Handle) {
        if let Ok(mut client) = self.client() {
            if let Ok(Some(released)) = client.release(&ReleaseKey::Handle(*handle)) {
                let _ = identity::remove(&self.ctx.identity_dir, released.id);
            }
        }
    }

    fn answer_within(&mut self, limit: Duration) {
        self.ctx.timeout = limit;
    }
}
