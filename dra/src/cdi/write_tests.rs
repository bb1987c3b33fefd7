//! Writing a spec into a CDI directory that someone else can write to: what is planted at the
//! temporary name is never written through, and the spec is 0600 whatever was there.

use std::os::unix::fs::{MetadataExt, PermissionsExt};

use super::*;

const UID: &str = "5e1f0c2a-0000-4000-8000-00000000aa01";

fn edits() -> CdiEdits {
    CdiEdits {
        env: vec!["CUDA_VISIBLE_DEVICES=GPU-fake-0".into()],
        ..CdiEdits::default()
    }
}

fn temp_of(dir: &Path) -> PathBuf {
    dir.join(format!(".gpuplex.io-vgpu-{UID}.json.tmp"))
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o7777
}

#[test]
fn a_file_left_at_the_temporary_name_does_not_give_the_spec_its_mode() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(temp_of(dir.path()), "left over").unwrap();
    std::fs::set_permissions(temp_of(dir.path()), PermissionsExt::from_mode(0o644)).unwrap();
    let written = write(dir.path(), UID, &edits()).unwrap();
    assert_eq!(mode(&written), 0o600);
    assert!(!temp_of(dir.path()).exists());
}

#[test]
fn a_hard_link_at_the_temporary_name_is_not_written_through() {
    let dir = tempfile::tempdir().unwrap();
    let cdi = dir.path().join("cdi");
    std::fs::create_dir(&cdi).unwrap();
    let outside = dir.path().join("outside.json");
    std::fs::write(&outside, "kept").unwrap();
    std::fs::set_permissions(&outside, PermissionsExt::from_mode(0o644)).unwrap();
    std::fs::hard_link(&outside, temp_of(&cdi)).unwrap();
    let written = write(&cdi, UID, &edits()).unwrap();
    assert_eq!(std::fs::read_to_string(&outside).unwrap(), "kept");
    assert_eq!(mode(&outside), 0o644);
    assert_eq!(std::fs::metadata(&outside).unwrap().nlink(), 1);
    assert_eq!(mode(&written), 0o600);
    assert!(std::fs::read_to_string(&written)
        .unwrap()
        .contains("GPU-fake-0"));
}

#[test]
fn a_symlink_at_the_temporary_name_is_not_followed() {
    let dir = tempfile::tempdir().unwrap();
    let cdi = dir.path().join("cdi");
    std::fs::create_dir(&cdi).unwrap();
    let target = dir.path().join("target.json");
    std::os::unix::fs::symlink(&target, temp_of(&cdi)).unwrap();
    let written = write(&cdi, UID, &edits()).unwrap();
    assert!(!target.exists());
    assert_eq!(mode(&written), 0o600);
}

#[test]
fn a_directory_at_the_temporary_name_is_refused_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(temp_of(dir.path())).unwrap();
    let e = write(dir.path(), UID, &edits()).unwrap_err().to_string();
    assert!(e.starts_with("cannot remove the leftover"), "{e}");
    assert!(!e.contains('\n'));
    assert!(!spec_path(dir.path(), UID).exists());
}
