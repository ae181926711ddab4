"""A coding agent's tool set: 17 tools in the OpenAI function format, about 60 KB of JSON schemas.

Modelled on what coding agents send with every turn (shell, file reading and editing, search,
notebooks, web, a todo list, sub-agents): long multi-paragraph descriptions, strict object schemas,
enums, formats. Written for Talaria's benchmarks and tests; no product's text is copied.
"""

from __future__ import annotations

import textwrap

DRAFT_07 = "http://json-schema.org/draft-07/schema#"


def _text(s: str) -> str:
    return textwrap.dedent(s).strip()


def _tool(name: str, description: str, properties: dict, required: tuple[str, ...] = ()) -> dict:
    """One tool in the OpenAI function format, with the strict object schema agents send."""
    return {"type": "function", "function": {"name": name, "description": _text(description), "parameters": {
        "type": "object", "properties": properties, "required": list(required), "additionalProperties": False,
        "$schema": DRAFT_07}}}


def _string(description: str, **extra) -> dict:
    return {"type": "string", "description": _text(description), **extra}


def _number(description: str, **extra) -> dict:
    return {"type": "number", "description": _text(description), **extra}


def _boolean(description: str) -> dict:
    return {"type": "boolean", "description": _text(description)}


BASH = _tool("Bash", """
    Runs a bash command in a shell session that persists between calls, so environment variables,
    the working directory and shell functions set by one call are still there for the next. An
    optional timeout bounds how long the command may run. Every call is executed with the user's
    permissions on the user's machine, so treat it with the care you would take at your own terminal.

    Before you run a command:

    1. Check the directory. If the command creates files or directories, first use the LS tool to
       make sure the parent directory exists and is the one you mean. For example, before running
       `mkdir build/output`, list the project root and confirm that `build` is there.

    2. Quote paths. Any path that contains spaces or shell metacharacters must be wrapped in double
       quotes, e.g. `cd "/home/user/My Projects"` or `python "scripts/load data.py"`. Unquoted paths
       with spaces are split into several arguments and the command fails or, worse, acts on the
       wrong file.

    3. Run the command, then read its output carefully before deciding on the next step. A command
       that exits with a non-zero status has failed even if it printed something that looks normal.

    Usage notes:
      - The command argument is required.
      - You may give a timeout in milliseconds, at most 600000 (10 minutes). Without one the command
        is stopped after 120000 milliseconds (2 minutes).
      - Always write a short description (5 to 10 words) of what the command does, in the active voice,
        so the user can follow along: "Install the project's dependencies", "Run the unit tests for the
        parser module", "Show the changes staged for commit".
      - Output longer than 30000 characters is cut, and only the beginning and the end are returned.
        Redirect long output to a file and read the parts you need if the middle matters.
      - Set run_in_background to true for commands that keep running, such as development servers,
        file watchers or long builds. You do not need to append an ampersand. Use the BashOutput tool to
        read what a background command has printed since you last looked, and KillShell to stop it.
      - Do not use the shell to search for or read files: `find`, `grep`, `cat`, `head`, `tail` and `ls`
        all have dedicated tools (Glob, Grep, Read, LS) that are faster, respect ignore files and give
        the user a clearer view of what you are doing. If you must search from the shell, use `rg`
        (ripgrep), which is installed, rather than `grep -r`.
      - Chain dependent commands with `&&` so that a failure stops the chain; use `;` only when the
        later commands should run whatever happened before. Do not put newlines between commands,
        except inside quoted strings.
      - Keep the same working directory for the whole session: prefer absolute paths over `cd`. Change
        directory only when the user asks you to or when a tool insists on being run from a particular
        directory, and say so when you do.
        <good-example>
        pytest /project/tests/test_parser.py
        </good-example>
        <bad-example>
        cd /project/tests && pytest test_parser.py
        </bad-example>

    # Committing changes with git

    Create a commit only when the user asks for one. If it is not clear whether they want a commit,
    ask first. When you are asked to commit, follow these steps closely; run independent commands
    together in one message so the information arrives at once.

    1. Gather the state of the repository, running these commands in parallel:
       - `git status`, to see untracked files (never use the -uall flag, which can exhaust memory on
         large repositories);
       - `git diff` and `git diff --staged`, to see what will be committed;
       - `git log -n 10 --oneline`, to learn the style of the existing commit messages.

    2. Analyse the changes and draft a message:
       - List the files that changed or were added, and sort the changes by kind: a new feature, an
         improvement of an existing one, a bug fix, a refactoring, tests, documentation.
       - Do not commit files that probably hold secrets (.env files, credential JSON, private keys).
         If the user asked for them specifically, warn them before you go on.
       - Write one or two sentences that explain why the change was made rather than listing what
         changed; the diff already says what. Match the tone and format of the repository's history.
       - Check that the message is accurate and that nothing in it overstates the change.
       - Keep the first line under 72 characters, in the imperative mood ("Add retry to the upload
         client", not "Added retries"), and leave a blank line before any further explanation.
       - If the changes are unrelated to each other, suggest splitting them into several commits and
         ask the user before committing them together.

    3. Run these commands in order:
       - add the relevant untracked files to the index;
       - create the commit, passing the message through a heredoc so quoting cannot break it:
         git commit -m "$(cat <<'MSG'
         Describe the change here.
         MSG
         )"
       - run `git status` to confirm that the commit succeeded.

    4. If a pre-commit hook changed files and the commit failed, stage the hook's changes and try the
       commit once more. If it fails again, stop and report the hook's output to the user; do not keep
       retrying and never pass --no-verify unless the user asked for it.

    Important:
      - Never change the git configuration.
      - Never push to a remote unless the user explicitly asks you to.
      - Never use git commands with the -i flag (`git rebase -i`, `git add -i`): they wait for
        interactive input, which this tool cannot give.
      - If there is nothing to commit (no untracked files and no changes), do not create an empty commit.
      - Do not run additional commands only to read or explore code beyond the git commands above.

    # Opening pull requests

    Use the GitHub CLI (`gh`) through this tool for everything related to GitHub: issues, pull
    requests, checks and releases. If you are given a GitHub URL, use `gh` to fetch what it points to.
    When the user asks for a pull request:

    1. In parallel, find out the state of the branch since it diverged from the default branch:
       `git status`, `git diff`, whether the branch tracks a remote and is up to date with it, and
       `git log` together with `git diff <base>...HEAD` to see every commit that will be included
       (all of them, not only the latest).
    2. Draft a title of at most 70 characters and a summary of one to three bullet points, followed by
       a short test plan: a checklist of what a reviewer should verify.
    3. In parallel: create the branch if needed, push it with -u if it has no upstream, and create the
       pull request with `gh pr create --title "..." --body "$(cat <<'MSG' ... MSG)"`, again passing the
       body through a heredoc.
    4. Return the URL of the pull request to the user when you are done.

    Other common operations:
      - To read the review comments of a pull request: `gh api repos/OWNER/REPO/pulls/NUMBER/comments`.
      - To see why a check failed: `gh run view RUN_ID --log-failed`.

    # Working safely

    Commands run on the user's machine, with the user's credentials, in the user's repository. Before
    running anything that cannot be undone, stop and think about what it will do:
      - Never delete files or directories outside the project, and inside it prefer `git rm` or moving
        files aside to `rm -rf`. Never run `rm -rf` on a path built from a variable that might be empty.
      - Never run `git reset --hard`, `git clean -fd`, `git checkout -- .` or `git push --force` unless
        the user asked for exactly that: they destroy work that exists nowhere else.
      - Do not install packages globally or with sudo. Use the project's own package manager and
        environment (a virtual environment, `npm install` in the project, `cargo add`), and tell the
        user which packages you added and why.
      - Do not start services that listen on public interfaces, change system settings, or edit files
        in the user's home directory (shell profiles, SSH configuration) without being asked.
      - Never print, copy or send secrets. If a command's output contains a token or password, do not
        repeat it in your reply.
      - Commands that need network access may be slow or fail in restricted environments; if one
        fails for that reason, say so instead of retrying in a loop.

    # The environment

    The shell starts in the project's root directory, with the user's PATH and environment variables.
    Interactive programs do not work: anything that waits for input (an editor, a pager, a password
    prompt, a REPL) hangs until the timeout. Pass the flags that make tools non-interactive, such as
    `--yes`, `--no-pager`, `-y` or `CI=1`, and set `GIT_PAGER=cat` where a pager could start. Colours
    and progress bars are stripped from the output, but they still cost characters of the 30000-
    character limit, so prefer quiet or plain output modes (`--quiet`, `--no-color`, `--progress=plain`)
    when a command supports them. Commands that take longer than their timeout are killed, together
    with their children; a build that needs more time belongs in the background.

    # Builds and tests

    Find out how the project is built and tested before running anything: look at the README, the
    Makefile or justfile, package.json scripts, pyproject.toml, Cargo.toml or the CI configuration,
    and use the commands the project itself uses, with the same flags. Run the narrowest set of tests
    that covers your change first (one file or one test case), and the whole suite only at the end.
    When a test fails, read the failure in full before changing code: the first error is usually the
    real one, and later errors are often its consequences. Never weaken or delete a test to make it
    pass, and never mark a check as skipped without telling the user. Long builds belong in the
    background (run_in_background), so you can keep working while they run and read their output
    with BashOutput when they finish.
""", {
    "command": _string("The command to run, exactly as it should be passed to bash."),
    "timeout": _number("Optional timeout in milliseconds, at most 600000.", maximum=600000),
    "description": _string("""
        A clear, concise description of what the command does, in 5 to 10 words, e.g. "List files in
        the current directory", "Install the package's test dependencies", "Show the last five commits".
    """),
    "run_in_background": _boolean("""
        Set to true to run the command in the background; read its output later with BashOutput.
    """),
}, ("command",))

BASH_OUTPUT = _tool("BashOutput", """
    Returns the output that a command started in the background (Bash with run_in_background set)
    has written since the last time you read it, from both stdout and stderr, together with the
    shell's current status: running, completed, or killed, and the exit code once it has one.

    - Takes the id of the background shell that the Bash tool returned when it started the command.
    - Returns only new output, so calling it repeatedly streams a long-running command's progress
      without repeating what you have already seen.
    - You may give a regular expression in filter to keep only the matching lines, e.g. "error|warn"
      when a build prints thousands of lines. Lines that do not match are dropped for good: they will
      not be returned by a later call either, so do not filter when you may need the full log.
    - The ids of all background shells are listed by the /bashes command, and they appear in the
      system reminders you receive while the shells are alive.
    - A command that has completed keeps its remaining output until you read it, so it is safe to
      check on a build only when you need its result. Poll sparingly: reading every few seconds a
      command that takes minutes fills the conversation with partial logs. Do something useful in
      between, or wait for the system reminder that tells you the shell has finished.
""", {
    "bash_id": _string("The id of the background shell whose output you want."),
    "filter": _string("""
        Optional regular expression. Only output lines that match it are returned; the rest are
        discarded and cannot be read again.
    """),
}, ("bash_id",))

KILL_SHELL = _tool("KillShell", """
    Stops a shell that is running a command in the background, given its id, and returns whether it
    was stopped. Use it when a development server, watcher or long-running job is no longer needed,
    when a command is clearly stuck, or before starting a replacement that would compete for the same
    port or files. The ids of the running background shells are listed by the /bashes command.
    Stopping a shell that has already finished is harmless and reports that it was not running.
    Background shells are also stopped when the session ends; stop them earlier when you are done
    with them, so they do not hold ports, locks or memory the user needs.
""", {
    "shell_id": _string("The id of the background shell to stop."),
}, ("shell_id",))

GLOB = _tool("Glob", """
    Finds files by name with glob patterns, fast on a codebase of any size.

    - Supports the usual patterns: "**/*.py" for every Python file below the search directory,
      "src/**/*.{ts,tsx}" for TypeScript sources, "docs/*.md" for the top-level documentation files.
    - Returns the matching paths sorted by modification time, the most recently changed first, which
      usually puts the files the user is working on at the top.
    - Files ignored by the repository's .gitignore are skipped.
    - Use it whenever you need to find files by name. To search the contents of files, use Grep.
    - For an open-ended search that may need several rounds of globbing and grepping, start an agent
      with the Task tool instead: it keeps the intermediate results out of your context.
    - Patterns are matched against paths relative to the search directory. A pattern without a
      directory part, such as "*.py", matches only the search directory's own files; use "**/*.py" to
      descend into subdirectories.
    - Patterns are case-sensitive on Linux and case-insensitive on macOS and Windows file systems;
      match both spellings, e.g. "**/*.{jpg,JPG}", when the case of the extension is not known.
    - You can call several tools in one response. When a few searches could each be useful, it is
      often better to run them speculatively, all at once, than one after the other.
""", {
    "pattern": _string("The glob pattern to match file paths against."),
    "path": _string("""
        The directory to search in. Leave it out to search the current working directory; do not pass
        "undefined" or "null". Must be a valid directory path when given.
    """),
}, ("pattern",))

GREP = _tool("Grep", """
    A content search built on ripgrep. Use it for every search through the contents of files.

    Usage:
      - ALWAYS use Grep for search tasks. Never run `grep` or `rg` through the Bash tool: this tool is
        configured for the permissions and ignore rules of the workspace and returns results in a form
        that is easier to work with.
      - It supports full regular expressions in ripgrep's syntax, e.g. "log.*Error" or
        "function\\s+\\w+". Literal braces must be escaped: to find `interface{}` in Go code search for
        `interface\\{\\}`.
      - Restrict the files searched with glob (e.g. "*.js", "**/*.{ts,tsx}") or with type (e.g. "py",
        "rust", "go"); type uses ripgrep's built-in file types and is faster than a glob for the common
        languages.
      - output_mode chooses what comes back: "files_with_matches" (the default) lists the paths of the
        files that match; "content" shows the matching lines, and honours -A, -B, -C, -n and
        head_limit; "count" gives the number of matches per file.
      - By default a pattern matches within one line only. To match across line boundaries, such as
        `struct \\{[\\s\\S]*?field` spanning a struct definition, set multiline to true.
      - For an open-ended search that needs several rounds, use the Task tool with an agent instead.
      - head_limit keeps only the first N lines or entries of the result, whichever output mode is in
        use; it is the same as piping the result through `head -N`.

    Searching well: start with a specific pattern and widen it if nothing matches, rather than the
    other way round; a broad pattern over a large repository can return thousands of lines and crowd
    out everything else you know. Search for the definition of a symbol (e.g. "def parse_config" or
    "class Scheduler") before searching for its uses.

    Examples:
      - Every TODO comment in the Python sources, with line numbers: pattern "TODO", type "py",
        output_mode "content", -n true.
      - Which files import a module: pattern "^(from|import) requests", output_mode
        "files_with_matches".
      - A function's definition with ten lines of context: pattern "def load_config\\(",
        output_mode "content", -A 10.
      - How often each test file uses a fixture: pattern "tmp_path", glob "tests/**/*.py", output_mode
        "count".

    Results are sorted by modification time in files_with_matches mode. Binary files and files
    ignored by .gitignore are skipped; to search inside a dependency folder such as node_modules, give
    its path explicitly.
""", {
    "pattern": _string("The regular expression to search the contents of files for."),
    "path": _string("The file or directory to search in. Defaults to the current working directory."),
    "glob": _string("""
        Glob pattern that filters the files searched, e.g. "*.js" or "*.{ts,tsx}"; passed to ripgrep
        as --glob.
    """),
    "type": _string("""
        File type to search, e.g. "js", "py", "rust", "go", "java"; passed to ripgrep as --type. More
        efficient than glob for the standard file types.
    """),
    "output_mode": _string("""
        What to return: "content" shows matching lines (and honours -A/-B/-C, -n and head_limit),
        "files_with_matches" lists the matching files (honours head_limit), "count" shows the number
        of matches per file (honours head_limit). Defaults to "files_with_matches".
    """, enum=["content", "files_with_matches", "count"]),
    "-A": _number('Lines to show after each match (rg -A). Only with output_mode "content".'),
    "-B": _number('Lines to show before each match (rg -B). Only with output_mode "content".'),
    "-C": _number('Lines to show before and after each match (rg -C). Only with output_mode "content".'),
    "-n": _boolean('Show line numbers in the output (rg -n). Only with output_mode "content".'),
    "-i": _boolean("Case-insensitive search (rg -i)."),
    "multiline": _boolean("""
        Let the pattern span lines, with "." matching newlines (rg -U --multiline-dotall). Off by
        default: patterns match within single lines.
    """),
    "head_limit": _number("""
        Keep only the first N lines or entries of the output, like `| head -N`; works in every output
        mode. Without it everything ripgrep finds is returned.
    """),
}, ("pattern",))

LS = _tool("LS", """
    Lists the files and directories in a given directory. The path must be absolute, not relative.
    You may give glob patterns to leave out in ignore, e.g. ["node_modules", "*.pyc"]. Generally
    prefer Glob and Grep when you know which files you are looking for; LS is for getting a first look
    at the layout of a directory or for checking that a directory exists before writing into it.

    Directories with many entries are summarised: the listing is cut after the first thousand
    entries, with a note saying how many were left out. Build outputs, dependency folders and version
    control directories are usually not worth listing; ignore them, or list a more specific
    subdirectory. The listing marks directories with a trailing slash and does not follow symbolic
    links out of the project.
""", {
    "path": _string("The absolute path of the directory to list (must be absolute, not relative)."),
    "ignore": {"type": "array", "items": {"type": "string"},
               "description": "Glob patterns of entries to leave out of the listing."},
}, ("path",))

READ = _tool("Read", """
    Reads a file from the local filesystem. You can read any file directly with this tool. Assume it
    can read every file on the machine: when the user gives you the path of a file, read it, because
    a path you were given is assumed to be valid. Reading a file that does not exist is fine too; you
    get an error back.

    Usage:
      - file_path must be an absolute path, not a relative one.
      - By default up to 2000 lines are read from the beginning of the file.
      - You may give a line offset and a limit, which is especially useful for long files, but when you
        can, read the whole file rather than a slice of it.
      - Lines longer than 2000 characters are cut.
      - The result is formatted like `cat -n`: each line starts with its number (from 1), then a tab,
        then the line's content. The line numbers are not part of the file: never copy them into an
        Edit or Write.
      - Images (PNG, JPG and the like) are shown to you as images, since you can read them; PDF files
        are read page by page, text and pictures together; Jupyter notebooks (.ipynb) are returned with
        every cell and its outputs, code, text and visualisations alike.
      - Read directories with LS, not with this tool.
      - You can call several tools in one response. It is always better to read several files that may
        all be useful in one go than one after the other.
      - When the user hands you a screenshot, given as a path under a temporary directory, always read
        it with this tool: screenshots work with every path.
      - A file that exists but is empty comes back with a system reminder saying so in place of its
        content.
      - Large generated files (lock files, minified bundles, data dumps) are rarely worth reading in
        full: read the first lines to see their shape, then use Grep to find what you need in them.
      - Re-read a file after you or the user changed it, rather than relying on an earlier read: the
        line numbers and content you remember may no longer be right.
      - For PDF files longer than a few pages, read the pages you need: give offset as the first page
        and limit as the number of pages. Scanned PDFs without a text layer are returned as images of
        their pages.
""", {
    "file_path": _string("The absolute path of the file to read."),
    "offset": _number("The line number to start reading from. Only give it when the file is too large to read at once."),
    "limit": _number("The number of lines to read. Only give it when the file is too large to read at once."),
}, ("file_path",))

WRITE = _tool("Write", """
    Writes a file to the local filesystem, replacing the file at that path if there is one.

    Usage:
      - If the file already exists, you MUST read it with the Read tool first in this conversation.
        The write fails if you have not.
      - ALWAYS prefer editing existing files in the codebase. NEVER write a new file unless the task
        really needs one.
      - NEVER create documentation files (*.md) or README files on your own initiative. Write them only
        when the user asks for them explicitly.
      - Only use emoji if the user asks for them. Do not write emoji into files otherwise.
      - The content is written as given, byte for byte: keep the file's line endings and the
        indentation style of the surrounding code.
      - Write the whole file: this tool does not append. To change part of an existing file, use Edit
        or MultiEdit, which send only the changed text and cannot lose the rest of the file by mistake.
      - Parent directories are not created for you; check with LS that the directory exists first.
""", {
    "file_path": _string("The absolute path of the file to write (must be absolute, not relative)."),
    "content": _string("The content to write to the file."),
}, ("file_path", "content"))

EDIT = _tool("Edit", """
    Replaces text in a file with an exact string match.

    Usage:
      - You must have read the file with the Read tool at least once in this conversation before you
        edit it. The edit fails if you have not.
      - When you copy text from the Read tool's output into old_string, keep the indentation (tabs and
        spaces) exactly as it appears AFTER the line-number prefix. The prefix is spaces, the line
        number, then a tab; everything after that tab is the file's content to match. Never include
        any part of the prefix in old_string or new_string.
      - ALWAYS prefer editing existing files. NEVER write new files unless the task requires it.
      - Only use emoji if the user asks for them.
      - The edit FAILS if old_string occurs more than once in the file. Either give more surrounding
        context so that it is unique, or set replace_all to change every occurrence.
      - replace_all is meant for renaming a variable or changing a repeated string across the whole
        file; check the occurrences first so you do not change ones you did not mean to.
      - old_string and new_string must differ. An edit that would change nothing is refused.
      - After a successful edit you get back a snippet of the file around the change; use it to check
        the result instead of reading the whole file again.

    Common reasons an edit fails, and what to do:
      - "old_string not found": the text differs from the file, often in whitespace (tabs against
        spaces, trailing spaces, a different line ending) or because an earlier edit already changed
        it. Read the relevant lines again and copy them exactly.
      - "found N matches": add a line or two of unique context around the text, or use replace_all if
        every occurrence should change.
      - "file has been modified since it was read": the user or a formatter changed the file. Read it
        again before editing, so you do not overwrite their changes.
      - The edit succeeds but the code no longer works: check the snippet you get back, and run the
        relevant test or type checker, before moving on to the next change.
""", {
    "file_path": _string("The absolute path of the file to modify."),
    "old_string": _string("The text to replace."),
    "new_string": _string("The text to replace it with (must be different from old_string)."),
    "replace_all": _boolean("Replace every occurrence of old_string (default false).")
}, ("file_path", "old_string", "new_string"))

MULTI_EDIT = _tool("MultiEdit", """
    Makes several edits to one file in a single operation. It is built on the Edit tool and lets you
    perform several find-and-replace operations efficiently. Prefer it over Edit whenever you need to
    make more than one change to the same file.

    Before using it:
      1. Read the file with the Read tool to understand its content and context.
      2. Check the directory path, as you would for a new file.

    To make several edits, give:
      1. file_path: the absolute path of the file to modify (it must be absolute, not relative);
      2. edits: an array of edits, each with
         - old_string: the text to replace (it must match the file exactly, whitespace and indentation
           included);
         - new_string: the text to put in its place;
         - replace_all: whether to replace every occurrence of old_string (optional, default false).

    IMPORTANT:
      - The edits are applied in the order given, each to the result of the one before.
      - Each edit must be valid on its own, with the rules of the Edit tool.
      - The edits are atomic: either all of them succeed or none is applied.
      - Plan the edits so that an earlier one does not change the text a later one is looking for.
        Two edits that touch neighbouring lines are often better written as one.

    CRITICAL REQUIREMENTS:
      1. All of Edit's rules apply to every edit (exact match, uniqueness unless replace_all, the
         line-number prefix never included).
      2. The edits apply in sequence, in the order given.
      3. An edit whose old_string equals its new_string is refused.
      4. Because the edits apply in sequence, make sure each old_string still exists, unchanged, after
         the edits before it.

    WARNING:
      - The tool fails if an old_string does not match the file exactly, whitespace included.
      - The tool fails if old_string and new_string are the same.
      - An edit that matches several places without replace_all fails, and with it the whole call.

    When you make edits:
      - Make sure every edit leaves the code idiomatic and correct: the file should still parse,
        compile or import after the last edit, whatever state the intermediate edits leave it in.
      - Do not leave the code in a broken state between calls either; a user may run it at any time.
      - Always use absolute file paths, starting with /.
      - Only use emoji if the user asks for them.

    To create a new file, give a new file path, an empty old_string in the first edit and the file's
    content as its new_string; the following edits then apply to that content.

    Example: renaming a parameter and updating its two uses in one function, as one call:
      file_path: /project/src/report.py
      edits:
        1. old_string "def render(rows, width):", new_string "def render(rows, max_width):"
        2. old_string "    cut = width - 3", new_string "    cut = max_width - 3"
        3. old_string "    if len(line) > width:", new_string "    if len(line) > max_width:"
    Each old_string is unique in the file, none of them is changed by an earlier edit, and the file is
    valid Python after the last edit, so the call succeeds as a whole.
""", {
    "file_path": _string("The absolute path of the file to modify."),
    "edits": {
        "type": "array", "minItems": 1, "description": "The edits to make, applied in order, all or none.",
        "items": {"type": "object", "additionalProperties": False, "required": ["old_string", "new_string"],
                  "properties": {
                      "old_string": _string("The text to replace."),
                      "new_string": _string("The text to replace it with."),
                      "replace_all": _boolean("Replace every occurrence of old_string (default false)."),
                  }},
    },
}, ("file_path", "edits"))

NOTEBOOK_READ = _tool("NotebookRead", """
    Reads a Jupyter notebook (.ipynb) and returns its cells with their outputs: code cells with their
    source, execution count and results (text, tables, images and errors), markdown cells with their
    text. Use it to understand a notebook before changing it with NotebookEdit. The path must be
    absolute. Give cell_id to read a single cell of a long notebook; its id is shown beside every cell
    in the full listing.

    Outputs are returned as the notebook stored them when it was last saved: if the user has run cells
    since then without saving, what you see may be out of date. Very large outputs (long tables, many
    images) are truncated; read the specific cell when you need the rest.
""", {
    "notebook_path": _string("The absolute path of the notebook to read (must be absolute, not relative)."),
    "cell_id": _string("The id of a single cell to read. Leave it out to read every cell."),
}, ("notebook_path",))

NOTEBOOK_EDIT = _tool("NotebookEdit", """
    Replaces, inserts or deletes one cell of a Jupyter notebook (.ipynb file). Notebooks are
    interactive documents that mix code, text and visualisations, commonly used for data analysis and
    scientific computing.

    - notebook_path must be an absolute path, not a relative one.
    - cell_id names the cell to act on; the ids are shown by NotebookRead and by Read on the notebook.
    - edit_mode "replace" (the default) replaces the cell's source with new_source. "insert" adds a
      new cell after the cell named by cell_id, or at the start of the notebook without a cell_id, and
      needs cell_type. "delete" removes the cell named by cell_id; new_source is then ignored.
    - Replacing a code cell clears its outputs and execution count: the notebook is not run by this
      tool, so ask the user to run it, or run it with Bash, when the outputs matter.
    - Read the notebook first: cells are often long, and their order matters to the kernel state.
    - Keep each cell focused: rather than appending a large block to an existing cell, insert a new
      cell after it, so the user can run and inspect the steps one at a time.
    - Markdown cells are rendered by the notebook front end: use headings and lists there, and keep
      prose out of code cells' comments when a markdown cell would explain it better.
""", {
    "notebook_path": _string("The absolute path of the notebook to edit (must be absolute, not relative)."),
    "cell_id": _string("""
        The id of the cell to edit. When inserting, the new cell goes after this one, or first in the
        notebook when no id is given.
    """),
    "new_source": _string("The new source of the cell."),
    "cell_type": _string("The type of the cell. Required with edit_mode insert; defaults to the current type.",
                         enum=["code", "markdown"]),
    "edit_mode": _string("The kind of edit: replace (the default), insert or delete.",
                         enum=["replace", "insert", "delete"]),
}, ("notebook_path", "new_source"))

WEB_FETCH = _tool("WebFetch", """
    Fetches the content of a URL and answers a prompt about it with a small, fast model.

    - Takes a URL and a prompt as input.
    - Fetches the URL and converts HTML to markdown.
    - Runs the prompt over the converted content with a small, fast model.
    - Returns the model's answer about the content, not the content itself.
    - Use this tool when you need to retrieve and analyse web content.

    Usage notes:
      - IMPORTANT: if a tool provided by an MCP server offers web fetching, prefer it over this tool:
        it may have fewer restrictions. Such tools have names that start with "mcp__".
      - The URL must be a fully formed, valid URL. HTTP URLs are upgraded to HTTPS automatically.
      - The prompt should say what information you want from the page, as precisely as you can: the
        small model sees only the page and your prompt, not the conversation.
      - This tool is read-only and does not modify any files.
      - Results may be summarised when the content is very large.
      - Responses are cached for 15 minutes, so repeated requests for the same URL are fast.
      - When a URL redirects to a different host, the tool tells you so and returns the redirect URL
        instead of following it. Make a new WebFetch request with that URL to fetch its content.
      - For GitHub URLs prefer the gh command through the Bash tool (`gh pr view`, `gh issue view`,
        `gh api`): it is authenticated and returns structured data.
      - Pages behind a login, or that need JavaScript to render their content, usually come back empty
        or as an error page; say so to the user rather than guessing what the page contains.
      - Do not use this tool to download files for use in the project (archives, binaries, datasets):
        it returns a model's answer, not the bytes. Use the project's package manager, or ask the user.
      - Ask for quotes when the exact wording matters (an error message, a configuration key, a
        version constraint): the small model paraphrases unless told not to.
""", {
    "url": _string("The URL to fetch content from.", format="uri"),
    "prompt": _string("What to find out from the fetched content."),
}, ("url", "prompt"))

WEB_SEARCH = _tool("WebSearch", """
    Searches the web and returns the results, formatted as search result blocks with titles, links and
    short excerpts, to inform your answers with information more recent than your training data.

    - Use it for current events, recently released versions of libraries and tools, error messages
      you do not recognise, and documentation that may have changed since your knowledge cutoff.
    - Searches are made in a single call; the results include links you can then read with WebFetch.
    - allowed_domains keeps only results from the listed domains; blocked_domains drops results from
      the listed domains. Give at most one of the two.
    - Web search is only available in some regions; where it is not, the tool returns an error.

    Keep queries short and specific: the name of the library or tool, its version if it matters, and
    the exact words of an error message in quotes. Account for the current date when searching for
    recent information: a query for "latest release" with last year's date returns last year's news.

    After answering from search results, list the sources you used at the end of your reply, as
    markdown links, so the user can check them:

        Sources:
        - [Title of the first page](https://example.com/first)
        - [Title of the second page](https://example.com/second)

    Prefer primary sources (the project's own documentation, release notes, changelogs and issue
    tracker) over blog posts and question-and-answer sites when they disagree, and say which one you
    relied on. A search result's excerpt is not the page: read the page with WebFetch before quoting it.
""", {
    "query": _string("The search query to use.", minLength=2),
    "allowed_domains": {"type": "array", "items": {"type": "string"},
                        "description": "Only include search results from these domains."},
    "blocked_domains": {"type": "array", "items": {"type": "string"},
                        "description": "Never include search results from these domains."},
}, ("query",))

TODO_WRITE = _tool("TodoWrite", """
    Creates and updates a structured task list for the current coding session. It helps you track
    progress, organise complex work and show the user how far you have come, and it helps the user
    see that you understood everything they asked for.

    ## When to use this tool

    Use it proactively in these situations:

    1. Complex multi-step tasks: the work needs three or more distinct steps or actions.
    2. Non-trivial tasks that need careful planning or several operations.
    3. The user explicitly asks for a todo list.
    4. The user gives several tasks at once, as a numbered or comma-separated list.
    5. New instructions arrive: capture the user's requirements as todos straight away.
    6. You start working on a task: mark it in_progress BEFORE you begin. Ideally only one todo is in
       progress at a time.
    7. You finish a task: mark it completed, and add any follow-up tasks you discovered on the way.

    ## When NOT to use this tool

    Skip it when:

    1. There is only one simple, straightforward task.
    2. The task is trivial and tracking it gives no organisational benefit.
    3. The task can be done in fewer than three trivial steps.
    4. The request is purely conversational or informational.

    Do not use the list for a single trivial task: in that case just do the task directly.

    The list is shown to the user as you update it, so it doubles as a progress report: a good list
    lets the user see at a glance what is done, what is happening now and what is still to come,
    without reading the whole conversation. Keep the entries short, and write them as actions
    ("Add a migration for the new column"), not as topics ("Database").

    ## Examples of when to use the todo list

    <example>
    User: Add a --verbose flag to the CLI and make sure the tests still pass when you are done.
    Assistant: I will add the flag, wire it through to the logger and then run the tests. Let me
    create a todo list to track this.
    *Creates a list: 1. Add the --verbose option to the argument parser; 2. Pass the level to the
    logger set-up; 3. Document the flag in the help text; 4. Run the test suite and fix any failures*
    Assistant: Starting with the argument parser.

    <reasoning>
    The assistant used the list because:
    1. The change touches several places (parser, logger, documentation).
    2. The user asked for the tests to pass, which makes running them an explicit final step.
    3. Writing the steps down makes sure none is forgotten.
    </reasoning>
    </example>

    <example>
    User: Rename the function fetch_rows to load_rows everywhere in the project.
    Assistant: Let me search for every occurrence of fetch_rows first.
    *Uses Grep and finds 14 occurrences in 6 files*
    Assistant: There are 14 uses in 6 files. I will make a todo list with one entry per file so I can
    update each of them systematically.
    *Creates a list with one item per file, each naming the occurrences to change*

    <reasoning>
    The assistant used the list because:
    1. It first searched to learn how big the task was.
    2. The uses are spread over several files, so there are several steps.
    3. The list lets the assistant check off every file and makes the progress visible.
    </reasoning>
    </example>

    <example>
    User: I need a settings page, a CSV export of the orders table and an email notification when an
    order ships.
    Assistant: Those are three separate features; I will put them on a todo list and start with the
    settings page.
    *Creates a list that breaks each feature into concrete tasks*

    <reasoning>
    The user gave several features at once, as a list. The todo list organises them into manageable
    tasks and lets the assistant track each of them to the end.
    </reasoning>
    </example>

    <example>
    User: The dashboard is slow to load. Can you make it faster?
    Assistant: Let me look at how the dashboard fetches and renders its data first.
    *Reads the components and the API handlers, and finds an N+1 query, an unindexed column and a
    chart that re-renders on every keystroke*
    Assistant: I found three problems. I will create a todo list with one entry for each fix.

    <reasoning>
    The assistant first examined the code to find the specific problems, then used the list because
    the fixes are independent and each needs its own change and verification.
    </reasoning>
    </example>

    <example>
    User: Upgrade the project from version 2 to version 3 of the web framework.
    Assistant: Let me read the framework's migration guide and look at how the project uses it.
    *Fetches the migration guide with WebFetch and greps the codebase for the deprecated APIs*
    Assistant: The upgrade needs changes to routing, middleware, the test client and the settings
    module. I will create a todo list with one entry per area, plus a final entry to run the full
    test suite.
    *Creates the list and marks the routing entry in_progress*

    <reasoning>
    A migration touches many files for several independent reasons. The list keeps track of which
    areas are done, and the final entry makes sure the suite is run once everything has changed.
    </reasoning>
    </example>

    <example>
    User: Fix the flaky test in test_scheduler.py, and while you are at it, the warning the build
    prints about a deprecated option.
    Assistant: Two separate problems; I will track them on a todo list.
    *Creates: 1. Reproduce the flaky test by running it in a loop; 2. Find and fix the race;
    3. Replace the deprecated build option; 4. Run the tests and the build to confirm*

    <reasoning>
    The user asked for two unrelated fixes in one message, and the flaky test alone needs several
    steps (reproduce, diagnose, fix, verify). The list stops the second request from being forgotten
    while the first one takes longer than expected.
    </reasoning>
    </example>

    <example>
    User: Set up continuous integration for this repository: lint, type-check and test on every
    pull request, on the two Python versions we support.
    Assistant: I will look at how the project is linted and tested today, then write the workflow.
    *Reads pyproject.toml and the Makefile, and lists the existing workflow directory*
    Assistant: There is no workflow yet. I will create a todo list: 1. Write the workflow with a
    version matrix; 2. Add the lint and type-check jobs with the project's own commands; 3. Cache the
    dependencies; 4. Validate the workflow file; 5. Tell the user which checks to mark as required.

    <reasoning>
    Setting up CI is a multi-step task with a step the assistant cannot do itself (configuring the
    repository's required checks). The list makes that hand-off visible instead of leaving it implicit.
    </reasoning>
    </example>

    ## Examples of when NOT to use the todo list

    <example>
    User: How do I print the type of a variable in Python?
    Assistant: Use the built-in type(): print(type(x)).

    <reasoning>
    One question, answered in one step, with nothing to track.
    </reasoning>
    </example>

    <example>
    User: What does git stash do?
    Assistant: It saves your uncommitted changes away and restores a clean working tree; `git stash
    pop` brings them back.

    <reasoning>
    An informational request: no code is written and no steps are taken.
    </reasoning>
    </example>

    <example>
    User: Add a docstring to the parse_date function.
    Assistant: *Edits the function to add the docstring*

    <reasoning>
    A single, small change in one place. A todo list would add nothing.
    </reasoning>
    </example>

    <example>
    User: Run the linter for me.
    Assistant: *Runs the linter with the Bash tool and reports the result*

    <reasoning>
    One command with an immediate result; there is nothing to plan or track.
    </reasoning>
    </example>

    ## Task states and management

    1. Task states. Use these to track progress:
       - pending: the task is not started yet;
       - in_progress: you are working on it now (limit this to ONE task at a time);
       - completed: the task is finished.

    2. Task management:
       - Update the status in real time as you work.
       - Mark a task completed IMMEDIATELY after finishing it; do not batch several completions.
       - Have only one task in progress at any time.
       - Finish the current task before you start a new one.
       - Remove tasks that are no longer relevant from the list entirely.

    3. Task completion requirements:
       - ONLY mark a task completed when you have FULLY accomplished it.
       - If you hit errors, blockers, or cannot finish, keep the task in_progress.
       - When you are blocked, add a new task describing what needs to be resolved.
       - Never mark a task completed if the tests are failing, the implementation is partial, errors
         are unresolved, or you could not find files or dependencies it needs.

    4. Task breakdown:
       - Create specific, actionable items.
       - Break complex tasks into smaller, manageable steps.
       - Use clear, descriptive task names.

    When in doubt, use this tool. Being proactive with task management shows attentiveness and makes
    sure you complete every requirement.
""", {
    "todos": {
        "type": "array", "description": "The updated todo list: every task, in order.",
        "items": {"type": "object", "additionalProperties": False,
                  "required": ["content", "status", "priority", "id"],
                  "properties": {
                      "content": _string("What the task is, in a short imperative sentence.", minLength=1),
                      "status": _string("Where the task stands.", enum=["pending", "in_progress", "completed"]),
                      "priority": _string("How important the task is.", enum=["high", "medium", "low"]),
                      "id": _string("A stable identifier for the task, unique within the list."),
                  }},
    },
}, ("todos",))

TASK = _tool("Task", """
    Launches a new agent that handles a complex, multi-step task autonomously, with its own context
    and its own set of tools, and returns its final report to you.

    Available agent types and the tools they have access to:
      - general-purpose: a general agent for researching complex questions, searching for code and
        carrying out multi-step tasks. When you are searching for a keyword or a file and are not
        confident you will find the right match in the first few tries, use this agent to search for
        you. (Tools: all tools.)
      - code-reviewer: reviews a change for correctness, style and missing tests once a logical chunk
        of work is written, and reports the problems it finds with file and line. (Tools: Read, Grep,
        Glob, LS, Bash.)
      - test-runner: runs the relevant test suites after a change, reads the failures and proposes
        minimal fixes, without editing files itself. (Tools: Bash, Read, Grep, Glob.)
      - docs-writer: drafts or updates documentation pages and docstrings to match the code, in the
        project's existing style. (Tools: Read, Write, Edit, MultiEdit, Grep, Glob, LS.)
      - migration-planner: inventories the uses of a deprecated API or library across the codebase and
        writes an ordered migration plan, with the risky call sites first. (Tools: Read, Grep, Glob,
        LS, WebFetch.)
      - security-auditor: looks for injection, unsafe deserialisation, secrets in the repository and
        missing input validation in the code it is pointed at, and ranks what it finds by severity.
        (Tools: Read, Grep, Glob, LS.)

    When using the Task tool, you must give a subagent_type to choose the agent type.

    When NOT to use the Task tool:
      - If you want to read a specific file path, use Read or Glob instead: it is faster.
      - If you are searching for a specific class definition like "class Foo", use Glob instead.
      - If you are searching for code within a specific file or a set of two or three files, use Read.
      - For tasks unrelated to the agent descriptions above.

    Usage notes:
      1. Launch several agents concurrently whenever possible, to maximise performance: put several
         Task calls in one message.
      2. When an agent is done it returns a single message to you. The result is not visible to the
         user: to show it, send the user a text message with a concise summary of the result.
      3. Each agent invocation is stateless. You cannot send further messages to the agent, and it
         cannot talk to you outside its final report. Your prompt should therefore contain a highly
         detailed task description for the agent to perform on its own, and say exactly what
         information the agent should return in its final and only message.
      4. The agent's outputs should generally be trusted, but check claims that matter before acting
         on them.
      5. Tell the agent clearly whether you expect it to write code or only to do research (search,
         read files, fetch web pages), since it does not know the user's intent.
      6. If an agent description says it should be used proactively, try to use it without waiting
         for the user to ask. Use your judgement.

    Example usage:

    <example>
    User: "Please write a function that checks whether a number is prime"
    Assistant: Sure, let me write that function.
    *Writes the function with the Write tool*
    Assistant: Now let me use the code-reviewer agent to review the code.
    *Uses the Task tool to launch the code-reviewer agent*
    <commentary>
    A significant piece of code was written, so the code-reviewer agent is used to review it.
    </commentary>
    </example>

    <example>
    User: "Where do we retry failed uploads?"
    Assistant: *Uses the Task tool with the general-purpose agent, asking it to find every place that
    retries an upload, with file paths and line numbers, and to report how many times each retries*
    <commentary>
    The answer may be spread over several modules with different names for the same idea, so an
    open-ended search by an agent keeps the intermediate results out of the main conversation.
    </commentary>
    </example>

    <example>
    User: "I have finished the new export module, can you check it and make sure the tests cover it?"
    Assistant: *In one message, uses the Task tool twice: the code-reviewer agent to review the export
    module, and the test-runner agent to run the export tests and report the coverage of the module*
    <commentary>
    Two independent pieces of work, so both agents are launched concurrently in a single message.
    </commentary>
    </example>

    Writing a good prompt for an agent: state the goal, the context the agent cannot know (the
    relevant files, the user's constraints, what has already been tried), the boundaries of the work
    (which files it may change, whether it may run commands) and the exact shape of the answer you
    want back (a list of file paths with line numbers, a yes or no with evidence, a patch). An agent
    that is told only "look into the bug" spends its effort rediscovering what you already know.

    Agents do not see your todo list or the conversation with the user, and they do not share files
    you have read. If the agent needs to know a decision the user made, write the decision into the
    prompt. When several agents work at once, give them disjoint pieces of work so they do not edit
    the same files; two agents editing one file will overwrite each other's changes.

    Do not launch an agent for work you could finish with two or three direct tool calls: starting an
    agent costs time, and its report is a summary that may leave out details you would have seen
    yourself. Agents pay off for broad searches, long investigations and independent work that can run
    in parallel with yours.
""", {
    "description": _string("A short (3-5 word) description of the task."),
    "prompt": _string("The task for the agent to perform."),
    "subagent_type": _string("The type of specialised agent to use for this task."),
}, ("description", "prompt", "subagent_type"))

EXIT_PLAN_MODE = _tool("ExitPlanMode", """
    Use this tool when you are in plan mode and have finished presenting your plan and are ready to
    code. It asks the user to leave plan mode; the plan you give is shown to them for approval.

    IMPORTANT: only use this tool when the task requires planning the implementation steps of a task
    that needs writing code. For research tasks, where you are gathering information, searching files,
    reading files or in general trying to understand the codebase, do NOT use this tool.

    Examples:
      1. Initial task: "Search for and understand how the cache is invalidated in the codebase". Do
         not use the exit plan mode tool: you are not planning the implementation steps of a task.
      2. Initial task: "Help me implement yank mode for vim". Use the exit plan mode tool after you have
         finished planning the implementation steps of the task.
      3. Initial task: "Add a dark theme to the settings page, and tell me which components would need
         changes". The second half is research, but the first half is code: plan both, and exit plan
         mode when the plan is ready.

    If the user's request is ambiguous, ask your clarifying questions before presenting the plan,
    rather than presenting a plan that guesses. If the user rejects the plan, revise it with their
    feedback and present it again; do not start implementing a plan that was not approved.

    A good plan names risks as well as steps: what could break (a public API, a database migration,
    a configuration format other code reads), how you will find out (which tests, which manual
    check), and what you will do if a step turns out harder than expected. Keep it to what the user
    needs to approve; the details of each edit belong in the implementation, not in the plan.

    The plan should be concise and in markdown: the files you will change, what each change is, and how
    you will verify the result. Do not start editing files before the user has approved the plan.
""", {
    "plan": _string("""
        The plan you came up with, which you want the user to approve. Supports markdown. The plan
        should be pretty concise.
    """),
}, ("plan",))

TOOLS = [BASH, READ, WRITE, EDIT, MULTI_EDIT, GLOB, GREP, LS, NOTEBOOK_READ, NOTEBOOK_EDIT, WEB_FETCH, WEB_SEARCH,
         TODO_WRITE, TASK, EXIT_PLAN_MODE, BASH_OUTPUT, KILL_SHELL]
