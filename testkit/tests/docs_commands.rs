//! The docs cannot drift from the binaries: every command line in
//! `README.md` and `docs/*.md` that runs an rfaas binary (in a code block,
//! or as inline code) names subcommands and flags that binary's `--help`
//! lists. The binaries are those `cargo build --workspace` makes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use rfaas_testkit::{repo_root, target_dir};

/// The binaries whose command lines are checked.
const BINARIES: &[&str] = &[
    "rfaas-manager",
    "rfaasctl",
    "rfaas-executord",
    "rfaas-token",
    "rfaas-worker",
    "rfaas-accounting",
    "rfaas-billing",
    "rfaas-slurm-hook",
    "rfaas-bench",
    "rfaas-fabric-bench",
    "rfaas-control-bench",
    "rfaas-harvest",
    "rfaas-fabric-probe",
];

/// One command line, and where it was found.
#[derive(Debug)]
struct Found {
    place: String,
    words: Vec<String>,
}

/// The pages checked.
fn pages() -> Vec<PathBuf> {
    let root = repo_root();
    let mut pages = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// Splits a command line into words as a shell would for these purposes:
/// quotes kept together, and the line ends at a comment, a pipe, a
/// redirection or a list operator.
fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut quote = None;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '\'' | '"') => quote = Some(c),
            (None, '#') if word.is_empty() => break,
            (None, '|' | '>' | '<' | ';' | '&') => break,
            (None, c) if c.is_whitespace() => {
                if !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
            }
            (None, '\\') => {
                if let Some(n) = chars.next() {
                    word.push(n);
                }
            }
            (None, c) => word.push(c),
        }
    }
    if !word.is_empty() {
        words.push(word);
    }
    words
}

/// The command's words from the binary on, if `words` runs one: after
/// `sudo`, `env`, `time`, `exec`, `runuser -u USER --`, a prompt (`$`,
/// `node-a$`) and `NAME=value` assignments; the binary may be given by a
/// path.
fn command_of(words: &[String]) -> Option<Vec<String>> {
    let mut i = 0;
    while i < words.len() {
        let w = words[i].as_str();
        if w == "runuser" {
            i += 1;
            while let Some(option) = words.get(i).filter(|o| o.starts_with('-')) {
                i += match option.as_str() {
                    "--" => 1,
                    "-u" | "-g" | "--user" | "--group" => 2,
                    _ => 1,
                };
                if option.as_str() == "--" {
                    break;
                }
            }
            continue;
        }
        let assignment = w.split_once('=').is_some_and(|(name, _)| {
            !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        });
        // A prompt (`$`, `node-a$`), a prefix command, or `NAME=value`.
        if w.ends_with('$') || matches!(w, "sudo" | "env" | "time" | "exec" | "!") || assignment {
            i += 1;
            continue;
        }
        let name = Path::new(w).file_name()?.to_str()?;
        return BINARIES.contains(&name).then(|| {
            std::iter::once(name.to_owned())
                .chain(words[i + 1..].iter().cloned())
                .collect()
        });
    }
    None
}

/// Every command line of `text` that runs an rfaas binary.
fn commands(page: &str, text: &str) -> Vec<Found> {
    let mut found = Vec::new();
    let mut fence: Option<String> = None;
    let mut pending = String::new();
    let mut pending_line = 0;
    for (n, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if let Some(rest) = trimmed.strip_prefix("```") {
            fence = match fence {
                Some(_) => None,
                None => Some(rest.trim().to_owned()),
            };
            continue;
        }
        match &fence {
            // Output, not commands.
            Some(lang) if lang == "text" || lang == "json" || lang == "toml" => {}
            Some(_) => {
                if pending.is_empty() {
                    pending_line = n + 1;
                }
                if let Some(joined) = trimmed.strip_suffix('\\') {
                    pending.push_str(joined);
                    pending.push(' ');
                    continue;
                }
                pending.push_str(trimmed);
                if let Some(words) = command_of(&shell_words(&pending)) {
                    found.push(Found {
                        place: format!("{page}:{pending_line}"),
                        words,
                    });
                }
                pending.clear();
            }
            None => {
                for (k, span) in line.split('`').enumerate() {
                    if k % 2 == 1 {
                        if let Some(words) = command_of(&shell_words(span)) {
                            found.push(Found {
                                place: format!("{page}:{}", n + 1),
                                words,
                            });
                        }
                    }
                }
            }
        }
    }
    found
}

/// What one `--help` says: its subcommands, and its flags with whether
/// each takes a value.
#[derive(Debug, Default)]
struct Help {
    subcommands: BTreeSet<String>,
    flags: BTreeMap<String, bool>,
}

/// `binary path... --help`, parsed; cached.
fn help<'a>(cache: &'a mut BTreeMap<Vec<String>, Help>, path: &[String]) -> &'a Help {
    if !cache.contains_key(path) {
        let exe = target_dir().join("debug").join(&path[0]);
        assert!(
            exe.exists(),
            "{} is not built; `cargo build --workspace` builds it",
            exe.display()
        );
        let out = Command::new(&exe)
            .args(&path[1..])
            .arg("--help")
            .output()
            .unwrap_or_else(|e| panic!("run {}: {e}", exe.display()));
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success() && !text.is_empty(),
            "{} --help failed: {}",
            path.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        let mut h = Help::default();
        let mut in_commands = false;
        for line in text.lines() {
            if line.starts_with("Commands:") {
                in_commands = true;
                continue;
            }
            if !line.starts_with(' ') {
                in_commands = false;
            }
            let t = line.trim_start();
            if in_commands {
                if let Some(name) = t.split_whitespace().next() {
                    h.subcommands.insert(name.to_owned());
                }
                continue;
            }
            // "-s, --long <VALUE>  text", "--long <VALUE>", "--long FILE",
            // "--long=VALUE": the flags first, then what they take.
            let words: Vec<&str> = t.split_whitespace().collect();
            let flags: Vec<&str> = words
                .iter()
                .map(|w| w.trim_end_matches(',').trim_end_matches("..."))
                .take_while(|w| w.starts_with('-') && w.len() > 1)
                .collect();
            let next = words.get(flags.len()).copied().unwrap_or("");
            let takes_next = next.starts_with('<')
                || (next.len() > 1 && next.chars().all(|c| c.is_ascii_uppercase() || c == '_'));
            for flag in flags {
                let (flag, inline) = match flag.split_once('=') {
                    Some((f, _)) => (f, true),
                    None => (flag, false),
                };
                h.flags.insert(flag.to_owned(), inline || takes_next);
            }
        }
        cache.insert(path.to_vec(), h);
    }
    &cache[path]
}

/// What is wrong with one command line, if anything.
fn check(cache: &mut BTreeMap<Vec<String>, Help>, words: &[String]) -> Result<(), String> {
    let mut path = vec![words[0].clone()];
    let mut i = 1;
    let mut positionals = 0;
    while i < words.len() {
        let w = words[i].trim_matches(|c| c == '[' || c == ']');
        let h = help(cache, &path);
        if w.starts_with("--") || (w.starts_with('-') && w.len() == 2 && w != "-") {
            let flag = w.split_once('=').map_or(w, |(f, _)| f);
            let takes = match h.flags.get(flag) {
                Some(t) => *t,
                None => {
                    return Err(format!(
                        "`{}` has no flag {flag} (its --help lists {:?})",
                        path.join(" "),
                        h.flags.keys().collect::<Vec<_>>()
                    ))
                }
            };
            i += if takes && !w.contains('=') { 2 } else { 1 };
            continue;
        }
        // A word where a subcommand goes: lower case, not a value.
        let looks_like_command = !w.is_empty()
            && w.chars().all(|c| c.is_ascii_lowercase() || c == '-')
            && !w.starts_with('-');
        if positionals == 0 && !h.subcommands.is_empty() {
            if looks_like_command {
                if !h.subcommands.contains(w) {
                    return Err(format!(
                        "`{}` has no subcommand {w} (its --help lists {:?})",
                        path.join(" "),
                        h.subcommands
                    ));
                }
                path.push(w.to_owned());
                i += 1;
                continue;
            }
            // `prolog|epilog`, `drain NAME | resume NAME`, `A|B` alternatives.
            if w.split('|').all(|a| h.subcommands.contains(a)) {
                path.push(w.split('|').next().unwrap_or_default().to_owned());
                i += 1;
                continue;
            }
        }
        positionals += 1;
        i += 1;
    }
    Ok(())
}

#[test]
fn every_documented_command_line_matches_its_binary() {
    let root = repo_root();
    let mut cache = BTreeMap::new();
    let mut checked = 0;
    let mut wrong = Vec::new();
    let mut seen_binaries = BTreeSet::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let name = page.strip_prefix(&root).unwrap().display().to_string();
        for found in commands(&name, &text) {
            checked += 1;
            seen_binaries.insert(found.words[0].clone());
            if let Err(e) = check(&mut cache, &found.words) {
                wrong.push(format!(
                    "{}: {}\n    {e}",
                    found.place,
                    found.words.join(" ")
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {checked} documented command lines do not match their binaries:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
    // The check reads what it should: the main tools appear in the docs.
    for tool in [
        "rfaasctl",
        "rfaas-manager",
        "rfaas-executord",
        "rfaas-billing",
        "rfaas-token",
    ] {
        assert!(
            seen_binaries.contains(tool),
            "no command line runs {tool}; {seen_binaries:?}"
        );
    }
    assert!(checked > 50, "only {checked} command lines found");
}

#[test]
fn the_check_catches_a_wrong_flag_and_a_wrong_subcommand() {
    let mut cache = BTreeMap::new();
    let words = |line: &str| command_of(&shell_words(line)).unwrap();
    assert!(check(&mut cache, &words("rfaasctl --json nodes --fresh")).is_ok());
    assert!(check(&mut cache, &words("node-a$ rfaasctl nodes")).is_ok());
    // A short flag takes its long form's value; counted flags are flags.
    assert!(check(&mut cache, &words("rfaas-billing -S today -P")).is_ok());
    assert!(check(&mut cache, &words("rfaas-manager --verbose")).is_ok());
    // As another user: the command after runuser's options is checked.
    let e = check(
        &mut cache,
        &words("runuser -u rfaas -- rfaasctl nodes --stale"),
    )
    .unwrap_err();
    assert!(e.contains("no flag --stale"), "{e}");
    assert!(check(
        &mut cache,
        &words("sudo RFAAS_CONFIG_DIR=/x rfaasctl credential node n1 > f")
    )
    .is_ok());
    let e = check(&mut cache, &words("rfaasctl nodes --stale")).unwrap_err();
    assert!(e.contains("no flag --stale"), "{e}");
    let e = check(&mut cache, &words("rfaasctl credentail node n1")).unwrap_err();
    assert!(e.contains("no subcommand credentail"), "{e}");
    let e = check(
        &mut cache,
        &words("target/release/rfaas-token gen-secret /etc/rfaas/secret"),
    )
    .unwrap_err();
    assert!(e.contains("no subcommand gen-secret"), "{e}");
    let e = check(
        &mut cache,
        &words("rfaas-token mint --secret-file s --node n"),
    )
    .unwrap_err();
    assert!(e.contains("no flag --secret-file"), "{e}");
    // Values of flags are not subcommands.
    assert!(check(&mut cache, &words("rfaas-token keygen --key-id site-1")).is_ok());
    // Code blocks: continued lines join; text blocks are output.
    let page = "```sh\nrfaas-billing -S 2026-01-01 \\\n  --bogus\n```\n```text\nrfaasctl --nope\n```\nrun `rfaasctl drain NAME`.\n";
    let found = commands("p", page);
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(check(&mut cache, &found[0].words)
        .unwrap_err()
        .contains("--bogus"));
    assert!(check(&mut cache, &found[1].words).is_ok());
}

/// The shell blocks of `docs/install.md`, parsed here on their own:
/// (line of the fence, the host its `host=` names, or "" for none).
fn install_guide_blocks(text: &str) -> Vec<(usize, String)> {
    let mut blocks = Vec::new();
    let mut open = false;
    for (n, line) in text.lines().enumerate() {
        let Some(info) = line.trim_start().strip_prefix("```") else {
            continue;
        };
        if open {
            open = false;
            continue;
        }
        open = true;
        let mut words = info.split_whitespace();
        if matches!(words.next(), Some("sh" | "bash" | "shell" | "console")) {
            let host = words
                .find_map(|w| w.strip_prefix("host="))
                .unwrap_or_default();
            blocks.push((n + 1, host.to_owned()));
        }
    }
    blocks
}

/// `scripts/test-install-guide.sh list FILE`: its exit status, and the
/// (line, host) of each block it would run.
fn guide_script_list(file: &Path) -> (bool, Vec<(usize, String)>, String) {
    let out = Command::new("bash")
        .arg(repo_root().join("scripts/test-install-guide.sh"))
        .arg("list")
        .arg(file)
        .output()
        .expect("run scripts/test-install-guide.sh list");
    let listed = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(w.len(), 3, "not `N HOST LINE`: {l:?}");
            (w[2].parse().expect("a line number"), w[1].to_owned())
        })
        .collect();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.success(), listed, stderr)
}

/// CI runs docs/install.md block by block (scripts/test-install-guide.sh):
/// every shell block there names the host it runs on, the script takes
/// each of them in order, and the page walks all three hosts to the bill.
#[test]
fn the_install_guide_runs_every_shell_block_on_its_host() {
    let page = repo_root().join("docs/install.md");
    let text = std::fs::read_to_string(&page).unwrap();
    let blocks = install_guide_blocks(&text);
    let untagged: Vec<usize> = blocks
        .iter()
        .filter(|(_, host)| host.is_empty())
        .map(|(line, _)| *line)
        .collect();
    assert!(
        untagged.is_empty(),
        "docs/install.md: the shell blocks at lines {untagged:?} name no host \
         (```sh host=admin|manager|compute); CI would not run them"
    );
    let (ok, listed, stderr) = guide_script_list(&page);
    assert!(ok, "scripts/test-install-guide.sh list failed: {stderr}");
    assert_eq!(
        listed, blocks,
        "scripts/test-install-guide.sh takes other blocks than docs/install.md has"
    );
    for host in ["admin", "manager", "compute"] {
        assert!(
            blocks.iter().any(|(_, h)| h == host),
            "no block runs on host={host}"
        );
    }
    // The walk ends with the bill, on the manager host.
    let last = text.rsplit("```sh host=").next().expect("a host block");
    assert!(
        last.starts_with("manager") && last.contains("rfaas-billing"),
        "the guide's last block is not rfaas-billing on the manager host: {last:?}"
    );
}

#[test]
fn the_install_guide_script_refuses_a_block_it_could_not_run() {
    let dir = std::env::temp_dir().join(format!("rfaas-guide-blocks-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cases = [
        ("```sh\nls\n```\n", "2: a shell block names no host"),
        (
            "```sh host=moon\nls\n```\n",
            "2: host=moon is none of the hosts",
        ),
        ("```sh host=admin\nls\n", "2: this fence is never closed"),
        ("```text\nls\n```\n", "no ```sh host=NAME block"),
    ];
    for (i, (page, said)) in cases.iter().enumerate() {
        let file = dir.join(format!("case{i}.md"));
        std::fs::write(&file, format!("# A page\n{page}")).unwrap();
        let (ok, _, stderr) = guide_script_list(&file);
        assert!(!ok, "case {i} ({page:?}) was taken");
        assert!(
            stderr.contains(said),
            "case {i}: {stderr:?} does not say {said:?}"
        );
    }
    // An indented block keeps its lines, without the fence's indentation.
    let file = dir.join("indented.md");
    std::fs::write(
        &file,
        "- a step:\n\n  ```sh host=compute\n  echo one\n    echo two\n  ```\n",
    )
    .unwrap();
    let (ok, listed, stderr) = guide_script_list(&file);
    assert!(ok, "{stderr}");
    assert_eq!(listed, vec![(3, "compute".to_owned())]);
    let out = dir.join("blocks");
    let status = Command::new("bash")
        .arg(repo_root().join("scripts/test-install-guide.sh"))
        .args(["extract".as_ref(), file.as_os_str(), out.as_os_str()])
        .status()
        .unwrap();
    assert!(status.success());
    assert_eq!(
        std::fs::read_to_string(out.join("01-compute.sh")).unwrap(),
        "echo one\n  echo two\n"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
