//! The attach step of a Kubernetes claim's containers, defined once for the DRA driver that
//! writes it and the hook and the containerd shim that read it.
//!
//! The DRA driver pins a claim's vGPU before any of its containers exists and writes a CDI
//! spec for it; the runtime applies that spec to each container of the pod. The spec's last
//! edit is this step: a `createRuntime` hook, `gpuplex-hook --socket S attach HANDLE`, which
//! attaches the container (its id and init pid) to the claim's vGPU with the claim's handle.
//! Several containers of a pod attach with the one handle and share the vGPU.
//!
//! A runtime without the shim (podman, CRI-O, containerd's runc shim) runs the hook. The
//! containerd shim takes it out of the spec ([`take_attach_hook`]) and attaches the container
//! itself, as it does for a vGPU it reserved. The handle is a capability: the spec file that
//! carries it is root's alone (`0600`), and the container never sees it.

use std::path::Path;

use crate::protocol::cdi::CdiHook;
use gpuplex_scheduler::Handle;
use serde_json::Value;

/// The hook's stage word.
pub const ATTACH: &str = "attach";

/// The program name the hook runs under (`argv[0]`).
const PROGRAM: &str = "gpuplex-hook";

/// The claim's attach step: `hook` (the host's `gpuplex-hook`) attaching to the vGPU of
/// `handle` through the node socket `socket`.
pub fn attach_hook(hook: &Path, socket: &Path, handle: &Handle) -> CdiHook {
    CdiHook {
        hook_name: "createRuntime".into(),
        path: hook.display().to_string(),
        args: vec![
            PROGRAM.into(),
            "--socket".into(),
            socket.display().to_string(),
            ATTACH.into(),
            handle.to_string(),
        ],
        ..CdiHook::default()
    }
}

/// Takes a claim's attach step out of an OCI spec's `createRuntime` hooks: the handle it
/// attaches with, `None` when the spec has none. Refused (one line) when a step names no
/// handle gpuplex wrote, or when there are two: a container attaches to one claim's vGPU.
pub fn take_attach_hook(config: &mut Value) -> Result<Option<Handle>, String> {
    let Some(hooks) = config
        .get_mut("hooks")
        .and_then(|h| h.get_mut("createRuntime"))
        .and_then(Value::as_array_mut)
    else {
        return Ok(None);
    };
    let mut found = None;
    let mut error = None;
    hooks.retain(|hook| {
        let Some(word) = attach_argument(hook) else {
            return true;
        };
        match (word.parse::<Handle>(), found) {
            (Ok(handle), None) => found = Some(handle),
            (Ok(_), Some(_)) => {
                error.get_or_insert_with(|| {
                    "the container has two gpuplex claim devices (gpuplex.io/vgpu=...); a container uses one claim's vGPU".to_string()
                });
            }
            (Err(_), _) => {
                error.get_or_insert_with(|| {
                    "a gpuplex-hook attach hook in the spec names no handle gpuplex wrote; it is the DRA driver's, written into the claim's CDI spec".to_string()
                });
            }
        }
        false
    });
    match error {
        Some(e) => Err(e),
        None => Ok(found),
    }
}

/// The handle word of a hook that is a claim's attach step (`gpuplex-hook ... attach WORD`).
fn attach_argument(hook: &Value) -> Option<&str> {
    let args: Vec<&str> = hook
        .get("args")?
        .as_array()?
        .iter()
        .map(|a| a.as_str().unwrap_or(""))
        .collect();
    match args.as_slice() {
        [PROGRAM, .., ATTACH, word] => Some(word),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn handle(n: u8) -> Handle {
        Handle::from_bytes([n; 16])
    }

    fn config_with(hooks: Vec<Value>) -> Value {
        json!({"ociVersion": "1.0.2", "hooks": {"createRuntime": hooks, "poststop": [{"path": "/x"}]}})
    }

    #[test]
    fn the_step_is_taken_out_and_only_it() {
        let step = attach_hook(
            Path::new("/usr/local/bin/gpuplex-hook"),
            Path::new("/run/gpuplex/gpuplex.sock"),
            &handle(7),
        );
        assert_eq!(step.args[0], "gpuplex-hook");
        assert_eq!(
            step.args[3..],
            ["attach".to_string(), handle(7).to_string()]
        );
        let other = json!({"path": "/usr/bin/nvidia-ctk", "args": ["nvidia-ctk", "hook", "update-ldcache"]});
        let mut config = config_with(vec![other.clone(), serde_json::to_value(&step).unwrap()]);
        assert_eq!(take_attach_hook(&mut config), Ok(Some(handle(7))));
        assert_eq!(config["hooks"]["createRuntime"], json!([other]));
        assert_eq!(config["hooks"]["poststop"][0]["path"], "/x");
        assert_eq!(take_attach_hook(&mut config), Ok(None));
        assert_eq!(take_attach_hook(&mut json!({})), Ok(None));
    }

    #[test]
    fn a_forged_or_second_step_is_refused_in_one_line() {
        let forged = json!({"path": "/h", "args": ["gpuplex-hook", "attach", "../../etc/passwd"]});
        let e = take_attach_hook(&mut config_with(vec![forged])).unwrap_err();
        assert!(e.contains("names no handle gpuplex wrote"), "{e}");
        let step = |n| {
            serde_json::to_value(attach_hook(Path::new("/h"), Path::new("/s"), &handle(n))).unwrap()
        };
        let e = take_attach_hook(&mut config_with(vec![step(1), step(2)])).unwrap_err();
        assert!(
            e.contains("two gpuplex claim devices") && !e.contains('\n'),
            "{e}"
        );
    }
}
