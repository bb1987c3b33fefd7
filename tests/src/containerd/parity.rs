//! The rig of the parity tests (`containerd.rs`, `containerd_tasks.rs`): one check, run once
//! under containerd's runc shim and once under gpuplex's, with the same expectations.

use super::{can_run_containerd, Containerd, Setup, GPUPLEX};
use crate::NodeService;

/// A containerd for one runtime; under gpuplex, with a node service of one fake GPU that the
/// shim reaches through `$GPUPLEX_CONFIG`. Dropped in order: the containers, the service, the
/// directory.
pub struct ParityRig {
    /// The containerd.
    pub containerd: Containerd,
    _service: Option<NodeService>,
    _dir: tempfile::TempDir,
}

/// A [`ParityRig`] for `runtime` (`minor`: the fake GPU's device minor, distinct per test), or
/// `None` when `check` cannot run here.
pub fn parity_rig(check: &str, runtime: &str, minor: u32) -> Option<ParityRig> {
    if !can_run_containerd(&format!("{check} under {runtime}")) {
        return None;
    }
    let dir = tempfile::tempdir().expect("a temporary directory");
    let service =
        (runtime == GPUPLEX).then(|| NodeService::start(&dir.path().join("node"), 1, minor, ""));
    let containerd = Containerd::start(Setup {
        gpuplex_config: service.as_ref().map(|s| s.config.clone()),
        cri: false,
    });
    Some(ParityRig {
        containerd,
        _service: service,
        _dir: dir,
    })
}

/// Two tests of one parity check `check(runtime, minor)`: under runc and under gpuplex.
#[macro_export]
macro_rules! parity {
    ($check:ident, minor $minor:literal: $under_runc:ident, $under_gpuplex:ident) => {
        #[test]
        fn $under_runc() {
            $check($crate::containerd::RUNC, $minor);
        }

        #[test]
        fn $under_gpuplex() {
            $check($crate::containerd::GPUPLEX, $minor);
        }
    };
}
