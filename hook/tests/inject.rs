//! Injection into real runc containers, held in their `createRuntime` hook (see `support`).
//! Needs root, /usr/sbin/runc and busybox-static; skipped otherwise.

mod support;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use gpuplex_hook::inject::{
    allow_devices, bind_identity, create_device_nodes, deny_devices, remove_device_nodes,
    unbind_identity, DeviceRule, IdentityMount, InjectError,
};
use nix::errno::Errno;
use serde_json::json;
use support::{skip, Container};

const IDENTITY: &str = "{\"vgpu\":\"vgpu-7\",\"gpus\":[{\"uuid\":\"GPU-fake-0\"}]}\n";

fn namespace_of_this_thread() -> PathBuf {
    fs::read_link("/proc/thread-self/ns/mnt").unwrap()
}

#[test]
fn nodes_and_allow_rules_reach_the_container() {
    if skip("nodes_and_allow_rules_reach_the_container") {
        return;
    }
    let mut c = Container::paused("nodes", |_| {});
    let namespace = namespace_of_this_thread();
    let mounts = c.host_mounts();
    let allowed = c.fake_gpu(240, "/dev/nvidia0");
    let not_allowed = c.fake_gpu(241, "/dev/nvidia1");
    let devices = [allowed.clone(), not_allowed];

    let created = create_device_nodes(c.pid, &c.rootfs, &devices).unwrap();
    assert_eq!(
        created,
        [c.rootfs.join("dev/nvidia0"), c.rootfs.join("dev/nvidia1")]
    );
    let again = create_device_nodes(c.pid, &c.rootfs, &devices).unwrap();
    assert!(
        again.is_empty(),
        "existing nodes are kept, not created: {again:?}"
    );
    let rules = allow_devices(c.pid, std::slice::from_ref(&allowed)).unwrap();
    let rule = DeviceRule {
        major: 195,
        minor: 240,
        access: "rwm".into(),
    };
    assert_eq!(rules, std::slice::from_ref(&rule));
    let again = allow_devices(c.pid, &[allowed.clone(), allowed.clone()]).unwrap();
    assert!(
        again.is_empty(),
        "an allowed device is not added again: {again:?}"
    );

    // The host gained nothing: the nodes are on the container's /dev tmpfs, not in the host
    // directory underneath it; no mount; this thread's namespace is the one it had.
    assert!(!c.rootfs.join("dev/nvidia0").exists());
    assert!(!c.rootfs.join("dev/nvidia1").exists());
    assert_eq!(c.host_mounts(), mounts);
    assert_eq!(namespace_of_this_thread(), namespace);

    c.start();
    let (ok, out) = c.exec("stat -c '%F %t:%T %a %u:%g' /dev/nvidia0 /dev/nvidia1");
    assert!(ok, "{out}");
    assert_eq!(
        out,
        "character special file c3:f0 666 0:0\ncharacter special file c3:f1 666 0:0\n"
    );
    let (ok, out) = c.exec("cat /dev/nvidia0");
    assert!(
        !ok && out.contains("No such device or address"),
        "allowed: {out}"
    );
    let (ok, out) = c.exec("cat /dev/nvidia1");
    assert!(
        !ok && out.contains("Operation not permitted"),
        "not allowed: {out}"
    );

    deny_devices(c.pid, &rules).unwrap();
    let (ok, out) = c.exec("cat /dev/nvidia0");
    assert!(
        !ok && out.contains("Operation not permitted"),
        "denied again: {out}"
    );
    assert_eq!(allow_devices(c.pid, &[allowed]).unwrap(), [rule]);
    let (_, out) = c.exec("cat /dev/nvidia0");
    assert!(
        out.contains("No such device or address"),
        "allowed while running: {out}"
    );
}

#[test]
fn undo_removes_the_nodes_and_their_directories() {
    if skip("undo_removes_the_nodes_and_their_directories") {
        return;
    }
    let mut c = Container::paused("undo-nodes", |_| {});
    let devices = [
        c.fake_gpu(242, "/dev/dri/card0"),
        c.fake_gpu(243, "/dev/nvidia2"),
    ];
    let created = create_device_nodes(c.pid, &c.rootfs, &devices).unwrap();
    assert_eq!(
        created,
        ["dev/dri", "dev/dri/card0", "dev/nvidia2"].map(|p| c.rootfs.join(p))
    );
    remove_device_nodes(c.pid, &c.rootfs, &created).unwrap();
    remove_device_nodes(c.pid, &c.rootfs, &created).unwrap();
    c.start();
    let (ok, out) = c.exec("test ! -e /dev/dri && test ! -e /dev/nvidia2 && echo gone");
    assert!(ok && out == "gone\n", "{out}");

    // After the pivot, the rootfs is the namespace's root: the same calls still work.
    let created = create_device_nodes(c.pid, &c.rootfs, &devices).unwrap();
    assert_eq!(created.len(), 3);
    let (ok, out) = c.exec("stat -c '%t:%T' /dev/dri/card0 /dev/nvidia2");
    assert!(ok && out == "c3:f2\nc3:f3\n", "{out}");
    remove_device_nodes(c.pid, &c.rootfs, &created).unwrap();
    let (ok, out) = c.exec("test ! -e /dev/dri && test ! -e /dev/nvidia2 && echo gone");
    assert!(ok && out == "gone\n", "{out}");
}

#[test]
fn refuses_what_is_in_the_way_and_rolls_back() {
    if skip("refuses_what_is_in_the_way_and_rolls_back") {
        return;
    }
    let mut c = Container::paused("in-the-way", |_| {});
    let one_line = |e: &InjectError| {
        let message = e.to_string();
        assert!(!message.contains('\n'), "{message}");
        message
    };

    let error = create_device_nodes(c.pid, &c.rootfs, &[c.fake_gpu(244, "/dev/null")]);
    let error = error.unwrap_err();
    assert!(matches!(error, InjectError::Occupied { .. }), "{error:?}");
    let message = one_line(&error);
    assert!(
        message.contains("dev/null") && message.contains("character device 1:3"),
        "{message}"
    );

    let error = create_device_nodes(c.pid, &c.rootfs, &[c.fake_gpu(244, "/bin/busybox")]);
    assert!(one_line(&error.unwrap_err()).contains("a regular file"));

    // A symlink in the image never leads out of the rootfs (before the pivot an absolute one
    // would resolve against the host's tree).
    let outside = c.dir.path().join("outside");
    fs::create_dir(&outside).unwrap();
    std::os::unix::fs::symlink(&outside, c.rootfs.join("escape")).unwrap();
    let error = create_device_nodes(c.pid, &c.rootfs, &[c.fake_gpu(244, "/escape/nvidia0")]);
    let error = error.unwrap_err();
    assert!(matches!(error, InjectError::Occupied { .. }), "{error:?}");
    let message = one_line(&error);
    assert!(
        message.contains("escape") && message.contains("a symlink"),
        "{message}"
    );
    assert_eq!(fs::read_dir(&outside).unwrap().count(), 0);

    for path in ["dev/nvidia0", "/dev/../etc/nvidia0", "/"] {
        let error = create_device_nodes(c.pid, &c.rootfs, &[c.fake_gpu(244, path)]);
        let error = error.unwrap_err();
        assert!(
            matches!(error, InjectError::InvalidPath { .. }),
            "{path}: {error:?}"
        );
    }

    // A failure part-way removes what the call had created.
    let good = c.fake_gpu(245, "/dev/dri/card5");
    let error = create_device_nodes(
        c.pid,
        &c.rootfs,
        &[good.clone(), c.fake_gpu(245, "/dev/null")],
    );
    assert!(
        matches!(error, Err(InjectError::Occupied { .. })),
        "{error:?}"
    );
    c.start();
    let (ok, out) = c.exec("test ! -e /dev/dri && echo rolled-back");
    assert!(ok && out == "rolled-back\n", "{out}");
}

#[test]
fn identity_is_read_only_in_the_container() {
    if skip("identity_is_read_only_in_the_container") {
        return;
    }
    let mut c = Container::paused("identity", |_| {});
    let mounts = c.host_mounts();
    let identity = c.dir.path().join("vgpu-7.json");
    fs::write(&identity, IDENTITY).unwrap();

    let mount = bind_identity(c.pid, &c.rootfs, &identity).unwrap();
    let expected = IdentityMount {
        target: c.rootfs.join("run/gpuplex/vgpu.json"),
        created: ["run", "run/gpuplex", "run/gpuplex/vgpu.json"]
            .map(|p| c.rootfs.join(p))
            .to_vec(),
    };
    assert_eq!(mount, expected);
    // The host sees the empty mount point, not the mount.
    assert_eq!(fs::read_to_string(&mount.target).unwrap(), "");
    assert_eq!(c.host_mounts(), mounts);

    c.start();
    let (ok, out) = c.exec("cat /run/gpuplex/vgpu.json");
    assert!(ok && out == IDENTITY, "{out}");
    let (ok, out) = c.exec("echo x > /run/gpuplex/vgpu.json");
    assert!(!ok && out.contains("Read-only file system"), "{out}");
    let (ok, out) = c.exec("grep ' /run/gpuplex/vgpu.json ' /proc/self/mountinfo");
    assert!(
        ok && out.split(' ').nth(5).unwrap().starts_with("ro,"),
        "{out}"
    );
    assert_eq!(fs::read_to_string(&identity).unwrap(), IDENTITY);
}

#[test]
fn identity_on_a_read_only_rootfs() {
    if skip("identity_on_a_read_only_rootfs") {
        return;
    }
    // runc makes root.readonly read-only after the pivot: at createRuntime it is writable.
    let mut c = Container::paused("ro-rootfs", |config| {
        config["root"]["readonly"] = json!(true)
    });
    let identity = c.dir.path().join("vgpu-7.json");
    fs::write(&identity, IDENTITY).unwrap();
    let device = c.fake_gpu(246, "/dev/nvidia0");
    bind_identity(c.pid, &c.rootfs, &identity).unwrap();
    create_device_nodes(c.pid, &c.rootfs, std::slice::from_ref(&device)).unwrap();
    allow_devices(c.pid, &[device]).unwrap();
    c.start();
    let (ok, out) = c.exec("echo x > /x");
    assert!(
        !ok && out.contains("Read-only file system"),
        "the rootfs is read-only: {out}"
    );
    let (ok, out) = c.exec("cat /run/gpuplex/vgpu.json");
    assert!(ok && out == IDENTITY, "{out}");
    let (_, out) = c.exec("cat /dev/nvidia0");
    assert!(out.contains("No such device or address"), "{out}");
}

#[test]
fn unbind_identity_undoes_bind_identity() {
    if skip("unbind_identity_undoes_bind_identity") {
        return;
    }
    let mut c = Container::paused("unbind", |_| {});
    let identity = c.dir.path().join("vgpu-7.json");
    fs::write(&identity, IDENTITY).unwrap();
    let mount = bind_identity(c.pid, &c.rootfs, &identity).unwrap();
    unbind_identity(c.pid, &c.rootfs, &mount).unwrap();
    unbind_identity(c.pid, &c.rootfs, &mount).unwrap();
    assert!(!c.rootfs.join("run").exists());
    c.start();
    let (ok, out) = c.exec("test ! -e /run && echo gone");
    assert!(ok && out == "gone\n", "{out}");

    // After the pivot the host path names nothing in the namespace: the mount is carried in.
    let mount = bind_identity(c.pid, &c.rootfs, &identity).unwrap();
    let (ok, out) = c.exec("cat /run/gpuplex/vgpu.json");
    assert!(ok && out == IDENTITY, "{out}");
    unbind_identity(c.pid, &c.rootfs, &mount).unwrap();
    let (ok, out) = c.exec("test ! -e /run && echo gone");
    assert!(ok && out == "gone\n", "{out}");
    assert_eq!(fs::read_to_string(&identity).unwrap(), IDENTITY);
}

/// Unmounts a host mount made by a test, before its tempdir goes.
struct HostMount(PathBuf);

impl Drop for HostMount {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
    }
}

#[test]
fn identity_on_a_mount_the_container_lacks_is_carried_in() {
    if skip("identity_on_a_mount_the_container_lacks_is_carried_in") {
        return;
    }
    let private = |config: &mut serde_json::Value| {
        config["linux"]["rootfsPropagation"] = json!("private");
    };
    let mut c = Container::paused("carried", private);
    // A tmpfs mounted on the host now does not reach the container's private namespace, so
    // the identity's host path names nothing there.
    let late = c.dir.path().join("late");
    fs::create_dir(&late).unwrap();
    nix::mount::mount(
        Some("tmpfs"),
        &late,
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .unwrap();
    let _unmount = HostMount(late.clone());
    let identity = late.join("vgpu-7.json");
    fs::write(&identity, IDENTITY).unwrap();
    bind_identity(c.pid, &c.rootfs, &identity).unwrap();
    c.start();
    let (ok, out) = c.exec(&format!(
        "test ! -e {} && cat /run/gpuplex/vgpu.json",
        identity.display()
    ));
    assert!(ok && out == IDENTITY, "{out}");
    let (ok, out) = c.exec("echo x > /run/gpuplex/vgpu.json");
    assert!(!ok && out.contains("Read-only file system"), "{out}");
}

#[test]
fn a_process_that_is_gone_is_a_clear_error() {
    let mut child = Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let error = create_device_nodes(pid, dir.path(), &[]).unwrap_err();
    assert!(
        matches!(
            error,
            InjectError::Namespace {
                source: Errno::ENOENT,
                ..
            }
        ),
        "{error:?}"
    );
    let message = error.to_string();
    assert!(
        message.contains(&format!("container process {pid}")),
        "{message}"
    );
    let error = bind_identity(pid, Path::new("rootfs"), Path::new("/nonexistent")).unwrap_err();
    assert!(
        matches!(error, InjectError::InvalidPath { .. }),
        "{error:?}"
    );
}
