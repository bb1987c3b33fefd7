//! A unified diff of two texts (`diff -u`'s format, three lines of context), for `--dry-run`.
//!
//! The texts are configuration files of a few hundred lines: the lines they share at the start
//! and the end are set aside, and the rest is matched by a longest common subsequence. Past
//! [`MAX_CELLS`] the middle is shown as removed and added whole, which is still a correct diff.

/// The largest middle (lines before × lines after) matched line by line.
const MAX_CELLS: usize = 4_000_000;

/// Lines of context around each change.
const CONTEXT: usize = 3;

/// One line of a diff, by its index in the old or new text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    /// In both: (old index, new index).
    Same(usize, usize),
    /// Only in the old text.
    Removed(usize),
    /// Only in the new text.
    Added(usize),
}

/// The unified diff turning `old` into `new`, with `old_name` and `new_name` on its `---` and
/// `+++` lines; empty when the texts are equal. An absent file is an empty text named
/// `/dev/null`, as `diff -u --new-file` writes it.
pub fn unified(old_name: &str, old: &str, new_name: &str, new: &str) -> String {
    if old == new {
        return String::new();
    }
    let a: Vec<&str> = old.split_inclusive('\n').collect();
    let b: Vec<&str> = new.split_inclusive('\n').collect();
    let ops = script(&a, &b);
    let mut out = format!("--- {old_name}\n+++ {new_name}\n");
    for hunk in hunks(&ops) {
        let ops = &ops[hunk.0..hunk.1];
        let (old_start, old_count) = range(
            ops.iter().filter_map(|op| match op {
                Op::Same(i, _) | Op::Removed(i) => Some(*i),
                Op::Added(_) => None,
            }),
            first_position(ops, true),
        );
        let (new_start, new_count) = range(
            ops.iter().filter_map(|op| match op {
                Op::Same(_, j) | Op::Added(j) => Some(*j),
                Op::Removed(_) => None,
            }),
            first_position(ops, false),
        );
        out.push_str(&format!(
            "@@ -{old_start},{old_count} +{new_start},{new_count} @@\n"
        ));
        for op in ops {
            let (mark, line) = match *op {
                Op::Same(i, _) => (' ', a[i]),
                Op::Removed(i) => ('-', a[i]),
                Op::Added(j) => ('+', b[j]),
            };
            out.push(mark);
            out.push_str(line);
            if !line.ends_with('\n') {
                out.push_str("\n\\ No newline at end of file\n");
            }
        }
    }
    out
}

/// A hunk's start and length on one side, as `@@` writes them: from 1, or the line before an
/// empty range (0 at the top of the file).
fn range(mut lines: impl Iterator<Item = usize>, before: usize) -> (usize, usize) {
    match lines.next() {
        Some(first) => (first + 1, 1 + lines.count()),
        None => (before, 0),
    }
}

/// How many lines of the old (`old`) or new side come before a hunk's first line.
fn first_position(ops: &[Op], old: bool) -> usize {
    match ops.first() {
        Some(Op::Same(i, j)) => {
            if old {
                *i
            } else {
                *j
            }
        }
        // A hunk starts with context unless it starts at the top of both files.
        _ => 0,
    }
}

/// The edit script: the common start and end, and a longest common subsequence between.
fn script(a: &[&str], b: &[&str]) -> Vec<Op> {
    let prefix = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let suffix = a[prefix..]
        .iter()
        .rev()
        .zip(b[prefix..].iter().rev())
        .take_while(|(x, y)| x == y)
        .count();
    let (a_mid, b_mid) = (&a[prefix..a.len() - suffix], &b[prefix..b.len() - suffix]);
    let mut ops: Vec<Op> = (0..prefix).map(|i| Op::Same(i, i)).collect();
    ops.extend(middle(a_mid, b_mid).into_iter().map(|op| match op {
        Op::Same(i, j) => Op::Same(i + prefix, j + prefix),
        Op::Removed(i) => Op::Removed(i + prefix),
        Op::Added(j) => Op::Added(j + prefix),
    }));
    let (a_end, b_end) = (a.len() - suffix, b.len() - suffix);
    ops.extend((0..suffix).map(|k| Op::Same(a_end + k, b_end + k)));
    ops
}

/// The script between two texts with nothing in common at their ends.
fn middle(a: &[&str], b: &[&str]) -> Vec<Op> {
    let (n, m) = (a.len(), b.len());
    if n.saturating_mul(m) > MAX_CELLS {
        let mut ops: Vec<Op> = (0..n).map(Op::Removed).collect();
        ops.extend((0..m).map(Op::Added));
        return ops;
    }
    // lcs[i][j]: the longest common subsequence of a[i..] and b[j..].
    let width = m + 1;
    let mut lcs = vec![0u32; (n + 1) * width];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            lcs[i * width + j] = if a[i] == b[j] {
                lcs[(i + 1) * width + j + 1] + 1
            } else {
                lcs[(i + 1) * width + j].max(lcs[i * width + j + 1])
            };
        }
    }
    let (mut i, mut j) = (0, 0);
    let mut ops = Vec::with_capacity(n + m);
    while i < n || j < m {
        if i < n && j < m && a[i] == b[j] {
            ops.push(Op::Same(i, j));
            i += 1;
            j += 1;
        } else if j < m && (i == n || lcs[i * width + j + 1] >= lcs[(i + 1) * width + j]) {
            ops.push(Op::Added(j));
            j += 1;
        } else {
            ops.push(Op::Removed(i));
            i += 1;
        }
    }
    // Removals before additions within a run of changes, as diff prints them.
    let mut k = 0;
    while k < ops.len() {
        if matches!(ops[k], Op::Same(..)) {
            k += 1;
            continue;
        }
        let end = ops[k..]
            .iter()
            .position(|op| matches!(op, Op::Same(..)))
            .map_or(ops.len(), |p| k + p);
        ops[k..end].sort_by_key(|op| matches!(op, Op::Added(_)));
        k = end;
    }
    ops
}

/// The hunks of a script: ranges of it holding changes with up to [`CONTEXT`] lines around,
/// merged where their context meets.
fn hunks(ops: &[Op]) -> Vec<(usize, usize)> {
    let mut hunks: Vec<(usize, usize)> = Vec::new();
    for (k, op) in ops.iter().enumerate() {
        if matches!(op, Op::Same(..)) {
            continue;
        }
        let start = k.saturating_sub(CONTEXT);
        let end = (k + 1 + CONTEXT).min(ops.len());
        match hunks.last_mut() {
            Some(last) if start <= last.1 => last.1 = end,
            _ => hunks.push((start, end)),
        }
    }
    hunks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_texts_have_no_diff() {
        assert_eq!(unified("a", "x\ny\n", "b", "x\ny\n"), "");
    }

    #[test]
    fn an_appended_table_is_one_hunk_with_context() {
        let old = "a\nb\nc\nd\ne\n";
        let new = "a\nb\nc\nd\ne\n\n[t]\n  k = 1\n";
        assert_eq!(
            unified("old", old, "new", new),
            "--- old\n+++ new\n@@ -3,3 +3,6 @@\n c\n d\n e\n+\n+[t]\n+  k = 1\n"
        );
    }

    #[test]
    fn a_new_file_and_a_removed_one() {
        assert_eq!(
            unified("/dev/null", "", "f", "x\ny\n"),
            "--- /dev/null\n+++ f\n@@ -0,0 +1,2 @@\n+x\n+y\n"
        );
        assert_eq!(
            unified("f", "x\n", "/dev/null", ""),
            "--- f\n+++ /dev/null\n@@ -1,1 +0,0 @@\n-x\n"
        );
    }

    #[test]
    fn changes_far_apart_are_two_hunks_and_near_ones_one() {
        let lines: Vec<String> = (1..=20).map(|i| format!("line {i}\n")).collect();
        let changed = |at: &[usize]| -> String {
            let mut lines = lines.clone();
            for &i in at {
                lines[i - 1] = format!("changed {i}\n");
            }
            lines.concat()
        };
        let old = lines.concat();
        let diff = unified("o", &old, "n", &changed(&[2, 18]));
        assert_eq!(diff.matches("@@ -").count(), 2, "{diff}");
        assert!(
            diff.contains("@@ -1,5 +1,5 @@\n line 1\n-line 2\n+changed 2\n line 3\n"),
            "{diff}"
        );
        assert!(diff.contains("@@ -15,6 +15,6 @@\n"), "{diff}");
        let near = unified("o", &old, "n", &changed(&[5, 11]));
        assert_eq!(near.matches("@@ -").count(), 1, "{near}");
        assert!(near.contains("@@ -2,13 +2,13 @@\n"), "{near}");
    }

    #[test]
    fn a_line_without_newline_is_marked() {
        assert_eq!(
            unified("o", "a\nb", "n", "a\nb\nc\n"),
            "--- o\n+++ n\n@@ -1,2 +1,3 @@\n a\n-b\n\\ No newline at end of file\n+b\n+c\n"
        );
    }

    #[test]
    fn applying_the_script_gives_the_new_text() {
        let old = "p\nq\nr\ns\nt\nu\n";
        let new = "q\nr\nX\ns\nu\nv\n";
        let a: Vec<&str> = old.split_inclusive('\n').collect();
        let b: Vec<&str> = new.split_inclusive('\n').collect();
        let ops = script(&a, &b);
        let rebuilt: String = ops
            .iter()
            .filter_map(|op| match op {
                Op::Same(i, _) => Some(a[*i]),
                Op::Added(j) => Some(b[*j]),
                Op::Removed(_) => None,
            })
            .collect();
        assert_eq!(rebuilt, new);
        let kept = ops.iter().filter(|op| matches!(op, Op::Same(..))).count();
        assert_eq!(kept, 4); // q r s u
    }
}
